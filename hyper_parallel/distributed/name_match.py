"""Which plan key names a module: the one matcher every site uses. Torch-free.

Plans, recipe ``plan_overrides``, ``replace_module`` entries and a model's own TP plan
all name modules by a key that is either an exact module FQN
(``model.layers.0.mlp``) or an fnmatch glob (``model.layers.*.mlp``). The applier
decides which entry a module gets; every check that reports on a plan (lint, preflight
coverage, verify, the frozen plan's pattern compression) must name that same entry,
or it approves one entry while another is applied. So they all ask this module.

The rule:

- a key is a glob when it holds a glob character (``*``, ``?``, ``[``); other keys
  name one module exactly;
- matching is ``fnmatch.fnmatchcase``: case-sensitive on every platform, and ``*``
  crosses dots (``layers.*.mlp`` hits ``layers.0.mlp``, ``*.mlp`` hits every
  ``mlp``); a key that is a module's own name names that module only;
- precedence: an exact FQN key beats every glob; among globs, the one that comes
  *last* in the plan's order wins. The applier has always resolved a plan this way
  (glob hits assigned in key order, each overwriting the one before, then the exact
  keys on top), and it is the rule a reader expects from a list of overrides or a
  dict update: what is written later refines what is written earlier.

A key that matches no module is the caller's to refuse (each names its own file and
entry); this module only says which modules each key hits (``match_plan_keys``).
"""

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hyper_parallel.errors import HyperParallelError

GLOB_CHARS = "*?["

Entry = TypeVar("Entry")


def is_glob(key: str) -> bool:
    """True when ``key`` is a pattern rather than one module's name (precedence: exact wins)."""
    return any(char in key for char in GLOB_CHARS)


def name_matches(name: str, key: str) -> bool:
    """Whether ``key`` (exact FQN or glob) hits module ``name``; the one comparison, so no
    site can match case-insensitively or treat ``*`` differently."""
    return name == key or fnmatch.fnmatchcase(name, key)


def names_matching(key: str, names: Sequence[str]) -> list[str]:
    """The module names ``key`` hits, in ``names`` order: the module itself for a key that
    is a module's name (even one holding a glob character), else every glob match."""
    if key in names:
        return [key]
    return [name for name in names if fnmatch.fnmatchcase(name, key)]


@dataclass(frozen=True)
class PlanKeyMatches:
    """What a plan's keys hit in one model: per key the modules it matches, and per module
    the key whose entry applies (the precedence rule above)."""

    hits: dict[str, list[str]]  # key -> module names it matches (empty: matches nothing)
    applied: dict[str, str]  # module name -> the key that applies to it


def match_plan_keys(names: Iterable[str], keys: Iterable[str]) -> PlanKeyMatches:
    """Resolve ``keys`` (plan order) against a model's module ``names``.

    ``applied`` keeps the applier's order: modules reached by a glob first, in the
    order the globs first reach them, then modules that only an exact key names; its
    hooks and parameters are set up in that order."""
    ordered = list(names)
    known = frozenset(ordered)
    hits: dict[str, list[str]] = {}
    by_glob: dict[str, str] = {}
    by_exact: dict[str, str] = {}
    for key in keys:
        if key in known:
            hits[key] = [key]
            by_exact[key] = key
            continue
        hits[key] = [name for name in ordered if fnmatch.fnmatchcase(name, key)]
        for name in hits[key]:
            by_glob[name] = key  # a later glob overwrites an earlier one
    by_glob.update(by_exact)  # an exact key beats every glob
    return PlanKeyMatches(hits=hits, applied=by_glob)


def plan_entry_for(name: str, plan: Mapping[str, Entry]) -> tuple[str, Entry] | None:
    """``(key, entry)`` that applies to module ``name`` in ``plan``: its exact key, else the
    last glob that matches it; None when no key matches. Checks and reports use this, so
    they name the entry the applier applies. Without the model's names it reads a key
    holding a glob character as a glob even where that key is another module's own name
    (``experts[0]``), which ``match_plan_keys`` keeps to that module; module names with
    glob characters are the one case where the two could differ."""
    if name in plan:
        return name, plan[name]
    found = None
    for key, entry in plan.items():
        if is_glob(key) and fnmatch.fnmatchcase(name, key):
            found = (key, entry)
    return found


def in_precedence_order(keys: Sequence[str], names: Iterable[str] = ()) -> list[int]:
    """Indices of ``keys`` in the order to apply them so the one applied last is the one
    that wins: globs (and keys naming no module in ``names``) in their order, then exact
    keys in theirs. For sites that apply entries one after another (plan_overrides)."""
    known = frozenset(names)
    return sorted(range(len(keys)), key=lambda index: keys[index] in known or not is_glob(keys[index]))


class PlanEntryConflict(ValueError, HyperParallelError):
    """Two plan entries place one parameter (an entry of its module and one of an ancestor
    naming it as a child's, ``conv1d.weight``): no precedence decides which applies."""


@dataclass(frozen=True)
class PlacedParameter:
    """Which entry places one parameter (or buffer): the plan ``key`` whose entry applies to
    ``module`` (the module the entry is applied to), the ``state`` name that entry gives it
    (its own ``weight``, or a child's dotted ``conv1d.weight``) and the entry itself; its
    placement is ``state_shardings[state]`` of the entry."""

    key: str
    module: str
    state: str
    entry: object

    @property
    def placement(self) -> Mapping:
        """``{axis: placement}`` the entry gives the parameter."""
        return _state_shardings(self.entry)[self.state]


def placed_parameters(names: Iterable[str], plan: Mapping[str, Entry]) -> dict[str, PlacedParameter]:
    """Parameter FQN -> the entry that places it, for a model whose module names are
    ``names``: the one reading of how a plan's entries name parameters, which the applier,
    plan lint, preflight's coverage and shard checks and verify's diagnosis all use.

    An entry applies to a module by ``match_plan_keys``; the names in its
    ``state_shardings`` are relative to that module, dotted where they name a child's
    parameter that the module's own code uses (a head-split mixer placing its packed
    convolution's ``conv1d.weight``). A parameter named by two applied entries is refused
    (``PlanEntryConflict``): which of them the applier would use would depend on order."""
    matches = match_plan_keys(names, plan)
    placed: dict[str, PlacedParameter] = {}
    for module, key in matches.applied.items():
        for state in _state_shardings(plan[key]):
            name = f"{module}.{state}" if module else state
            if name in placed:
                other = placed[name]
                raise PlanEntryConflict(f"parameter {name} is placed by two plan entries: {other.key!r} (as "
                                        f"{other.state!r}) and {key!r} (as {state!r}); keep one of them")
            placed[name] = PlacedParameter(key, module, state, plan[key])
    return placed


def placement_of(param: str, plan: Mapping[str, Entry]) -> PlacedParameter | None:
    """``placed_parameters`` for one parameter without its model: the modules on its path
    are the prefixes of its name, which is all the one reading needs to place it."""
    parts = param.split(".")
    return placed_parameters([".".join(parts[:index]) for index in range(len(parts))], plan).get(param)


def _state_shardings(entry) -> Mapping:
    """An entry's ``state_shardings``: a ``ShardingConfig``'s attribute, or a plan file's key.
    A compact one-line entry (the generated literal's) is refused, not read as placing
    nothing: callers pass ``plan_format.plan_entries`` of it."""
    if isinstance(entry, str):
        raise TypeError(f"a compact plan entry ({entry[:40]!r}...): pass full entries (plan_format.plan_entries)")
    if isinstance(entry, Mapping):
        return entry.get("state_shardings") or {}
    return getattr(entry, "state_shardings", None) or {}
