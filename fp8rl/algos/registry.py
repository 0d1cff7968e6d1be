"""A tiny name -> object registry (verl's ``register_policy_loss`` pattern).

Losses, advantage estimators, KL estimators, rollout corrections and clip-bound policies are looked up by
the name a config gives. Two rules make config mistakes loud:

- looking up an unknown name raises :class:`UnknownNameError` (both a ``KeyError`` and a ``ValueError``)
  whose message lists the valid names, sorted;
- registering a *different* object under a taken name raises ``ValueError``; registering the same object
  again (e.g. an alias registered twice) is a no-op.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """Raised by :meth:`Registry.get` for a name that was never registered."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Maps names to objects of one kind (``kind`` is used in error messages only)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator registering the decorated object under ``name`` (and optional ``aliases``)."""

        def decorator(obj: T) -> T:
            for key in (name, *aliases):
                self.add(key, obj)
            return obj

        return decorator

    def add(self, name: str, obj: T) -> None:
        """Register ``obj`` under ``name``; a different object under a taken name raises ``ValueError``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} names must be non-empty strings, got {name!r}")
        existing = self._entries.get(name)
        if existing is not None and existing is not obj:
            raise ValueError(
                f"{self.kind} {name!r} is already registered to {_describe(existing)}; "
                f"refusing to overwrite it with {_describe(obj)}"
            )
        self._entries[name] = obj

    def get(self, name: str) -> T:
        """The object registered under ``name``; raises :class:`UnknownNameError` listing the valid names."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def _describe(obj: object) -> str:
    module = getattr(obj, "__module__", "?")
    qualname = getattr(obj, "__qualname__", type(obj).__qualname__)
    return f"{module}.{qualname}"


def declared_options(fn: Callable, **candidates: object) -> dict[str, object]:
    """Those of `candidates` that `fn` declares as keyword parameters: a config passes every option it has and
    each registered entry takes its own (no switch on the entry's name outside the registry)."""
    parameters = inspect.signature(fn).parameters
    return {name: value for name, value in candidates.items() if name in parameters}
