"""The model as opened, as the guard compares it: what decides a forward of `run.model` besides its weights and
inputs (`structure`, by where each thing is: every module, its type, its instance-level methods and hooks, torch's
global module hooks) and what transformers picks each layer's attention by (`dispatch`: configs, the
implementations they name, the registries those names are looked up in), and the same objects without their
names in a fixed order (`fingerprint`), compared by identity at every governed forward (`guard.py`).

Kept apart from the hooks that use it: this half only reads a model, and a reader checking what counts as "the
model changed" finds all of it here.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

from torch import nn

HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
         "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks",
         # what `state_dict()` runs while `save()` writes the adapter (review 8: a post-hook rewrote the saved
         # tensors, the weights in memory untouched)
         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
# What transformers decides a layer's attention by, besides the module: the implementation's name in the config the
# module holds (and its sub-configs), and the registries that name is looked up in (an `AttentionInterface` and its
# kind: attention masks, MoE experts), bound in the module defining the layer's class or in these
IMPLEMENTATIONS = ("_attn_implementation_internal", "_experts_implementation_internal")
DISPATCHERS = ("transformers.modeling_utils", "transformers.masking_utils", "transformers.integrations.moe")


def structure(model: nn.Module) -> dict[str, Any]:
    """What decides a forward of `model` besides its weights and inputs, by where it is: every module (path,
    object, type), each instance attribute that overrides a method of its class (`forward`), each hook of
    each module, torch's global module hooks, and what transformers picks each layer's attention by (`dispatch`).
    Compared by identity (the dict keeps every object alive)."""
    found: dict[str, Any] = {}
    for name, hooks in _global_hooks():
        found.update({f"torch's {name}[{key}]": hook for key, hook in hooks.items()})
    for path, module in model.named_modules(remove_duplicate=False):
        where, methods = path or "run.model", _methods(type(module))
        found[where] = module
        found[f"{where}'s type"] = type(module)
        found.update({f"{where}.{name}": value for name, value in vars(module).items() if name in methods})
        for hooks in HOOKS:
            found.update({f"{where}.{hooks}[{key}]": hook for key, hook in getattr(module, hooks, {}).items()})
    found.update(dispatch(model))
    return found


def dispatch(model: nn.Module) -> dict[str, Any]:
    """What transformers picks `model`'s attention, attention masks and MoE experts by, by where it is: the config
    each module holds, the implementation it and its sub-configs name (`IMPLEMENTATIONS`), and every registry such
    a name is looked up in, with each function it maps a name to. None of it is a module, method or hook:
    `set_attn_implementation` and `AttentionInterface.register` change what every attention layer computes."""
    found: dict[str, Any] = {}
    kinds: dict[type, None] = {}
    seen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        where, config = path or "run.model", vars(module).get("config")
        kinds[type(module)] = None
        if config is not None:
            found[f"{where}.config"] = config
            for at, each in _configs(config, f"{where}.config", seen):
                found.update({f"{at}.{name}": value for name, value in zip(IMPLEMENTATIONS, _implementations(each))})
    for at, registry in _registries(kinds):
        found[at] = registry
        for named, mapping in _mappings(at, registry):
            found[named] = mapping
            found.update({f"{named}[{key!r}]": function for key, function in mapping.items()})
    return found


def fingerprint(model: nn.Module) -> list[Any]:
    """What `structure` records, without the names, in an order fixed by the model: the objects alone (hook ids
    are the dicts' own key objects), compared one by one by identity at every governed forward (`structure`,
    which names each, only when they differ)."""
    found: list[Any] = []
    for _, hooks in _global_hooks():
        found += [*hooks.keys(), *hooks.values()]
    kinds: dict[type, None] = {}
    configs: list[Any] = []
    for _, module in model.named_modules(remove_duplicate=False):
        state, kind = module.__dict__, type(module)
        methods = _methods(kind)
        kinds[kind] = None
        found += [module, kind]
        found += [item for name, value in state.items() if name in methods for item in (name, value)]
        for name in HOOKS:
            hooks = state.get(name)
            if hooks:
                found += [name, *hooks.keys(), *hooks.values()]
        config = state.get("config")
        if config is not None:
            found.append(config)
            configs.append(config)
    seen: set[int] = set()
    for config in configs:
        for _, each in _configs(config, "", seen):
            found += _implementations(each)
    mappings: set[int] = set()
    for at, registry in _registries(kinds):
        found.append(registry)
        for _, mapping in _mappings(at, registry):
            if id(mapping) not in mappings:
                mappings.add(id(mapping))
                found += [mapping, *mapping.keys(), *mapping.values()]
    return found


def _global_hooks() -> list[tuple[str, dict]]:
    from torch.nn.modules import module as torch_module

    return [(name, hooks) for name, hooks in sorted(vars(torch_module).items())
            if name.startswith("_global_") and isinstance(hooks, dict)]


def _configs(config: Any, where: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """(where, config) of `config` and its sub-configs (a composite model's `text_config`), each once."""
    if id(config) in seen:
        return
    seen.add(id(config))
    yield where, config
    subconfigs = getattr(type(config), "sub_configs", None)
    if isinstance(subconfigs, dict):
        state = getattr(config, "__dict__", {})
        for key in subconfigs:
            if state.get(key) is not None:
                yield from _configs(state[key], f"{where}.{key}", seen)


def _implementations(config: Any) -> list[Any]:
    """The implementations `config` names (`IMPLEMENTATIONS`), strings interned: the same name set again is the
    same object, compared by identity."""
    state = getattr(config, "__dict__", {})
    return [sys.intern(value) if type(value) is str else value for value in map(state.get, IMPLEMENTATIONS)]


def _registries(kinds: dict[type, None]) -> list[tuple[str, Any]]:
    """(where, registry) of each registry of implementations by name (transformers' `GeneralInterface`:
    `ALL_ATTENTION_FUNCTIONS`, `ALL_MASK_ATTENTION_FUNCTIONS`, `ALL_EXPERTS_FUNCTIONS`) bound in one of
    `DISPATCHERS` or in a module that defines one of `kinds` (where that class's forward finds it), each once:
    what is bound now under each name that held one, so that a name bound to another object counts too."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for module in dict.fromkeys([*DISPATCHERS, *(kind.__module__ for kind in kinds)]):
        for where, space, name in _BOUND[module] if module in _BOUND else _bound_in(module):
            registry = space.get(name)
            if id(registry) not in seen:
                seen.add(id(registry))
                found.append((where, registry))
    return found


_BOUND: dict[str, tuple[tuple[str, dict[str, Any], str], ...]] = {}


def _bound_in(module: str) -> tuple[tuple[str, dict[str, Any], str], ...]:
    """(where, the module's globals, name) of each `GeneralInterface` bound in the module `module`, found once."""
    interface = getattr(sys.modules.get("transformers.utils.generic"), "GeneralInterface", None)
    if interface is None or module not in sys.modules:  # no transformers, or one before 4.48: no registry
        return ()
    if module not in _BOUND:
        space = vars(sys.modules[module])
        _BOUND[module] = tuple((f"{module}.{name}", space, name) for name, value in list(space.items())
                               if isinstance(value, interface))
    return _BOUND[module]


def _mappings(at: str, registry: Any) -> list[tuple[str, dict]]:
    """The mappings the registry bound at `at` looks a name up in, by where: its own (`_local_mapping`, which
    `registry[name] = f` writes) and its class's (`_global_mapping`, which `register` writes for every instance)."""
    kind = type(registry)
    own, shared = getattr(registry, "__dict__", {}).get("_local_mapping"), getattr(kind, "_global_mapping", None)
    return [(where, mapping) for where, mapping in ((f"{at}._local_mapping", own),
                                                    (f"{kind.__module__}.{kind.__qualname__}._global_mapping", shared))
            if isinstance(mapping, dict)]


_METHODS: dict[type, frozenset[str]] = {}


def _methods(kind: type) -> frozenset[str]:
    """The names of `kind`'s callable attributes: an instance attribute of one of these names overrides it."""
    if kind not in _METHODS:
        _METHODS[kind] = frozenset(name for name in dir(kind) if _callable(kind, name))
    return _METHODS[kind]


def _callable(kind: type, name: str) -> bool:
    try:
        return callable(getattr(kind, name, None))
    except Exception:  # a class-level descriptor that raises: whatever it is, an instance may shadow it
        return True

