"""Fragment plans: which whole tensors of the model form each of the P fragments.

Every peer computes the plan itself from the model's (name, shape) list, so the rule must be
deterministic: the same input gives the same plan on every machine, whatever the dict/hash order.

Patterns:
- ``"balanced"`` (the paper's default): greedy bin-packing of whole tensors, largest first, each into
  the lightest fragment. Ties: equal-size tensors are placed in name order; among equally light
  fragments the one with fewest tensors wins, then the lowest index (so no fragment stays empty
  while a tensor is left, even with zero-sized tensors).
- ``"strided"`` (Streaming DiLoCo): a tensor whose name contains ``blocks.{i}.`` goes to fragment
  ``i mod P``; the remaining tensors are bin-packed as above on top of those loads.

Inside a fragment, tensors keep the model's original order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from p2p_diloco.errors import ConfigError

PATTERNS = ("balanced", "strided")
LAYER_INDEX = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
"""Where the strided pattern finds a tensor's layer index (``blocks.3.attn.weight`` -> 3)."""


@dataclass(frozen=True)
class FragmentPlan:
    """Tensor names per fragment, with their element counts (`numels` mirrors `fragments`).

    `numels` may be left empty when only the names are known; `sizes()` then raises.
    """

    fragments: tuple[tuple[str, ...], ...]
    numels: tuple[tuple[int, ...], ...] = ()
    _index: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.fragments:
            raise ConfigError("a fragment plan needs at least one fragment")
        index: dict[str, int] = {}
        for p, names in enumerate(self.fragments):
            for name in names:
                if name in index:
                    raise ConfigError(f"tensor {name!r} is in fragments {index[name]} and {p}")
                index[name] = p
        if self.numels:
            if len(self.numels) != len(self.fragments) or any(
                len(n) != len(f) for n, f in zip(self.numels, self.fragments)
            ):
                raise ConfigError(
                    "FragmentPlan.numels must have one count per tensor name, fragment by fragment"
                )
            if any(n < 0 for counts in self.numels for n in counts):
                raise ConfigError("FragmentPlan.numels must be >= 0")
        object.__setattr__(self, "_index", index)

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_of(self, name: str) -> int:
        """The fragment holding tensor `name` (KeyError naming it if the plan has no such tensor)."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the fragment plan") from None

    def names(self, p: int) -> tuple[str, ...]:
        """Tensor names of fragment `p`, in the model's order."""
        if not 0 <= p < self.num_fragments:
            raise IndexError(f"fragment {p} out of range 0..{self.num_fragments - 1}")
        return self.fragments[p]

    def sizes(self) -> tuple[int, ...]:
        """Total number of elements per fragment."""
        if not self.numels:
            raise ConfigError("this FragmentPlan was built without numels; use plan_fragments()")
        return tuple(sum(counts) for counts in self.numels)

    def numel_of(self, name: str) -> int:
        p = self.fragment_of(name)
        if not self.numels:
            raise ConfigError("this FragmentPlan was built without numels; use plan_fragments()")
        return self.numels[p][self.fragments[p].index(name)]

    def all_names(self) -> tuple[str, ...]:
        """Every tensor name, fragment by fragment."""
        return tuple(name for names in self.fragments for name in names)


def layer_index(name: str) -> int | None:
    """The ``i`` in ``...blocks.{i}....``, or None for tensors outside the transformer blocks."""
    match = LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def plan_fragments(
    named_shapes: Sequence[tuple[str, tuple[int, ...]]], num_fragments: int, pattern: str = "balanced"
) -> FragmentPlan:
    """Split whole tensors into `num_fragments` fragments (see the module docstring for the rules).

    Raises ConfigError for empty input, duplicate names, negative dimensions, an unknown pattern,
    more fragments than tensors, or (strided only) a fragment left without tensors.
    """
    if pattern not in PATTERNS:
        raise ConfigError(f"fragment pattern must be one of {PATTERNS}, got {pattern!r}")
    if num_fragments < 1:
        raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
    if not named_shapes:
        raise ConfigError("cannot plan fragments for a model with no tensors")
    order: dict[str, int] = {}
    numel: dict[str, int] = {}
    for position, (name, shape) in enumerate(named_shapes):
        if name in order:
            raise ConfigError(f"duplicate tensor name {name!r} in the model's parameter list")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ConfigError(f"tensor {name!r} has a negative dimension in shape {dims}")
        order[name] = position
        numel[name] = math.prod(dims)
    if num_fragments > len(order):
        raise ConfigError(
            f"{num_fragments} fragments but only {len(order)} tensors: every fragment needs at least "
            f"one whole tensor; lower diloco.fragments to at most {len(order)}"
        )

    members: list[list[str]] = [[] for _ in range(num_fragments)]
    loads = [0] * num_fragments
    free = list(order)
    if pattern == "strided":
        free = []
        for name in order:
            i = layer_index(name)
            if i is None:
                free.append(name)
            else:
                members[i % num_fragments].append(name)
                loads[i % num_fragments] += numel[name]

    for name in sorted(free, key=lambda n: (-numel[n], n)):
        target = min(range(num_fragments), key=lambda p: (loads[p], len(members[p]), p))
        members[target].append(name)
        loads[target] += numel[name]

    empty = [p for p, names in enumerate(members) if not names]
    if empty:
        raise ConfigError(
            f"fragment pattern {pattern!r} left fragments {empty} without tensors "
            f"({num_fragments} fragments); use fewer fragments or the 'balanced' pattern"
        )
    fragments = tuple(tuple(sorted(names, key=order.__getitem__)) for names in members)
    return FragmentPlan(fragments, tuple(tuple(numel[n] for n in names) for names in fragments))
