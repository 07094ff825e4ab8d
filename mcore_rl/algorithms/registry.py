"""Name -> function registries for advantage estimators, policy losses and off-policy corrections.

The trainer picks an estimator, a policy loss and an off-policy correction by the name in its config and calls
them through `compute_advantages(name, **kwargs)` / `compute_policy_loss(name, **kwargs)` /
`compute_correction(name, **kwargs)`. The calling convention:

* Every registered function takes keyword arguments only for what it uses (no `*args`/`**kwargs`), so a direct
  call with a misspelt or irrelevant argument fails loudly.
* `compute_*` accepts the union of the argument names of all functions registered in that table: it passes each
  function the arguments it declares and drops the others, so one bundle (`scores`, `token_rewards`, `values`,
  `group_ids`, `response_mask`, `gamma`, `lam`, ...) works for every name. A name that no registered function
  declares raises ValueError (a typo), and so does a required argument that is missing or None.

Registering a new estimator, loss or correction is the extension point: decorate a function with
`@register_advantage("x")`, `@register_policy_loss("x")` or `@register_correction("x")` in a module that is
imported before the trainer looks the name up.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

AdvantageFn = Callable[..., Any]
PolicyLossFn = Callable[..., Any]
CorrectionFn = Callable[..., Any]

_ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {}
_POLICY_LOSSES: dict[str, PolicyLossFn] = {}
_CORRECTIONS: dict[str, CorrectionFn] = {}
_PARAMS: dict[Callable[..., Any], dict[str, inspect.Parameter]] = {}


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in table:
            raise ValueError(
                f"{kind} '{name}' is already registered (by {table[name].__qualname__}); pick another name"
            )
        params = inspect.signature(fn).parameters
        variadic = [p.name for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if variadic:
            raise ValueError(
                f"{kind} '{name}' ({fn.__qualname__}) takes *{variadic[0]}; registered functions must name every "
                "argument so that compute_* can route keyword arguments to them"
            )
        table[name] = fn
        _PARAMS[fn] = dict(params)
        return fn

    return decorator


def _lookup(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    if name not in table:
        raise ValueError(f"unknown {kind} '{name}'; known: {', '.join(sorted(table))}")
    return table[name]


def _call(table: dict[str, Callable[..., Any]], kind: str, name: str, kwargs: dict[str, Any]) -> Any:
    fn = _lookup(table, kind, name)
    accepted = _PARAMS[fn]
    known = set().union(*(_PARAMS[f] for f in table.values()))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"unknown keyword argument(s) {unknown} for {kind} '{name}'; "
            f"registered {kind}s accept only: {', '.join(sorted(known))}"
        )
    call_kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    missing = [
        p.name for p in accepted.values() if p.default is inspect.Parameter.empty and call_kwargs.get(p.name) is None
    ]
    if missing:
        raise ValueError(f"{kind} '{name}' needs {', '.join(f'{m}=' for m in missing)} (got None or nothing)")
    return fn(**call_kwargs)


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under `name` (ValueError if the name is taken)."""
    return _register(_ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_advantage_estimator(name: str) -> AdvantageFn:
    """The estimator registered as `name`; ValueError listing the known names otherwise."""
    return _lookup(_ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def list_advantage_estimators() -> list[str]:
    return sorted(_ADVANTAGE_ESTIMATORS)


def compute_advantages(name: str, **kwargs: Any) -> Any:
    """Call the estimator `name` with the subset of `kwargs` it declares; returns `(advantages, returns)`.

    See the module docstring for the routing rules and `advantages.py` for each estimator's arguments.
    """
    return _call(_ADVANTAGE_ESTIMATORS, "advantage estimator", name, kwargs)


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (ValueError if the name is taken)."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; ValueError listing the known names otherwise."""
    return _lookup(_POLICY_LOSSES, "policy loss", name)


def list_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def compute_policy_loss(name: str, **kwargs: Any) -> Any:
    """Call the policy loss `name` with the subset of `kwargs` it declares; returns `(loss, metrics)`."""
    return _call(_POLICY_LOSSES, "policy loss", name, kwargs)


def register_correction(name: str) -> Callable[[CorrectionFn], CorrectionFn]:
    """Decorator registering an off-policy correction under `name` (ValueError if the name is taken)."""
    return _register(_CORRECTIONS, "off-policy correction", name)


def get_correction(name: str) -> CorrectionFn:
    """The off-policy correction registered as `name`; ValueError listing the known names otherwise."""
    return _lookup(_CORRECTIONS, "off-policy correction", name)


def list_corrections() -> list[str]:
    return sorted(_CORRECTIONS)


def compute_correction(name: str, **kwargs: Any) -> Any:
    """Call the off-policy correction `name` with the subset of `kwargs` it declares; returns `(weights, metrics)`.

    See `off_policy.py` for each correction's arguments.
    """
    return _call(_CORRECTIONS, "off-policy correction", name, kwargs)
