"""Records declared like dataclasses, without their start-up cost.

`dataclasses` compiles fresh code for every class as its module is imported (and pulls in
`inspect`), and `typing.NamedTuple` compiles some too: 0.2 to 0.3 ms a class, which a launcher
started in front of every command cannot afford over some forty classes. A `Record` subclass
gets a generic __init__, __eq__ and __repr__ that read the class's annotations once; with
`frozen=True` it is also immutable and hashable, and `_replace` makes changed copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from typing import dataclass_transform
else:  # only type checkers read it, and Python 3.10 lacks it

    def dataclass_transform(**_: Any) -> Callable[[type], type]:
        return lambda cls: cls


_T = TypeVar("_T")


class _Factory:
    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def field(*, default_factory: Callable[[], _T]) -> _T:
    """A default made afresh for each record (a list, a dict), as `dataclasses.field`."""
    return _Factory(default_factory)  # type: ignore[return-value]


_MISSING: Any = object()


if TYPE_CHECKING:
    # For the type checker alone: a bound named by a string is compiled by Python, and the
    # first compile() of a process sets up its whole syntax tree module, some 0.9 ms of every
    # launch.
    _R = TypeVar("_R", bound="Record")


@dataclass_transform(field_specifiers=(field,))
class Record:
    """Base of records: fields are the class's annotations, in order, with their defaults."""

    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}
    _frozen: ClassVar[bool] = False

    def __init_subclass__(cls, *, frozen: bool = False) -> None:
        names = list(cls._fields)
        defaults = dict(cls._defaults)
        # With `from __future__ import annotations` these are strings; only the names matter.
        # (Not inspect.get_annotations: importing inspect is part of what this module avoids.)
        own = cls.__dict__.get("__annotations__", {})  # noqa: RUF063
        for name, annotation in own.items():
            if str(annotation).startswith(("ClassVar", "typing.ClassVar")):
                continue
            if name not in names:
                names.append(name)
            if name in cls.__dict__:
                defaults[name] = cls.__dict__[name]
                if isinstance(defaults[name], _Factory):
                    delattr(cls, name)
            elif name in defaults:
                raise TypeError(f"{cls.__name__}.{name} needs a default: an earlier field has one")
            elif any(n in defaults for n in names[: names.index(name)]):
                raise TypeError(
                    f"{cls.__name__}.{name}: a field without a default follows one with"
                )
        cls._fields = tuple(names)
        cls._defaults = defaults
        cls._frozen = frozen
        if frozen:
            cls.__setattr__ = _refuse_change  # type: ignore[method-assign,assignment]
            cls.__delattr__ = _refuse_change  # type: ignore[method-assign,assignment]
            cls.__hash__ = _hash_fields  # type: ignore[method-assign,assignment]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = self._fields
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes at most {len(fields)} values")
        values = dict(zip(fields, args, strict=False))
        for name, value in kwargs.items():
            if name in values or name not in fields:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated field {name!r}")
            values[name] = value
        if len(values) < len(fields):
            for name in fields:
                if name not in values:
                    default = self._defaults.get(name, _MISSING)
                    if default is _MISSING:
                        raise TypeError(f"{type(self).__name__}: missing field {name!r}")
                    values[name] = default.make() if isinstance(default, _Factory) else default
        self.__dict__.update(values)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self._fields)

    __hash__ = None  # type: ignore[assignment]  # mutable: equal records may not stay equal

    def _replace(self: _R, **changes: Any) -> _R:
        """A copy with some fields changed (the record itself may be frozen)."""
        unknown = set(changes).difference(self._fields)
        if unknown:
            raise TypeError(f"{type(self).__name__} has no field {sorted(unknown)[0]!r}")
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(changes)
        return copy

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"


def _refuse_change(self: Record, name: str, *_: Any) -> None:
    raise AttributeError(f"{type(self).__name__} is frozen: cannot change {name!r}")


def _hash_fields(self: Record) -> int:
    return hash(tuple(getattr(self, n) for n in self._fields))
