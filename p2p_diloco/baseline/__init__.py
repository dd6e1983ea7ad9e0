"""The lock-step baseline: elastic data-parallel training on `hivemind.Optimizer`.

`worker` runs one baseline peer (`p2p-diloco baseline-worker`), `elastic` configures and observes
hivemind's optimizer, `ledger` keeps a worker's counters and `checkpoint` its restart file. Goodput is
computed from the event logs of either system by `p2p_diloco.demo.accounting`. Nothing is imported
here: the modules pull in torch and hivemind.
"""
