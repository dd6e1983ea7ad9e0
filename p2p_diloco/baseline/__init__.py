"""The baselines the demo compares against, both on hivemind (`p2p-diloco baseline-worker --mode dp|diloco`).

``dp``, the lock-step baseline: elastic data-parallel training on `hivemind.Optimizer`. `worker` runs one
peer, `elastic` configures and observes hivemind's optimizer, `ledger` keeps a worker's counters and
`checkpoint` its restart file. ``diloco``, synchronous DiLoCo as OpenDiLoCo runs it: `diloco` runs one peer
(the same books, events and checkpoint file as `worker`), `outer_averager` is hivemind's all-reduce of
outer gradients and progress records, `rounds` the outer step and round rules (pure). Goodput is
computed from the event logs of any system by `p2p_diloco.demo.accounting`. Nothing is imported here:
the modules pull in torch and hivemind.
"""
