"""Function: a callable held as data, so that configs stay serializable.

``Function.Config(fn=kaiming_uniform_, kwargs={"a": 0.5})`` is called like the function
(``cfg(tensor)`` → ``kaiming_uniform_(tensor, a=0.5)``) and serializes as the function's
import path plus its keyword arguments. ``fn`` must be importable by that path: a
module-level function, not a lambda or a closure.
"""

from dataclasses import dataclass, field
from typing import Any, Callable

from hyper_parallel.protocols.config_dict import import_path, path_of, value_from_data, value_to_data
from hyper_parallel.protocols.configurable import Configurable


class Function(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        fn: Callable[..., Any]
        kwargs: dict[str, Any] = field(default_factory=dict)

        def __post_init__(self) -> None:
            if not callable(self.fn):
                raise TypeError(f"Function.Config.fn must be callable, got {self.fn!r}")
            if "<lambda>" in self.fn.__qualname__ or "<locals>" in self.fn.__qualname__:
                raise ValueError(
                    f"Function.Config.fn must be a module-level function (importable by path), "
                    f"got {self.fn.__module__}.{self.fn.__qualname__}")

        def __call__(self, *args: Any) -> Any:
            return self.fn(*args, **self.kwargs)

        def _fields_to_data(self) -> dict:
            """The function as its import path (a function is not data), then its kwargs."""
            return {"fn": path_of(self.fn), "kwargs": value_to_data(self.kwargs, "Function.Config.kwargs")}

        @classmethod
        def _from_data_fields(cls, data: dict) -> "Function.Config":
            """The inverse of ``_fields_to_data``: the function is imported by its path."""
            return cls(fn=import_path(data["fn"]), kwargs=value_from_data(data.get("kwargs", {})))

    def __call__(self, *args: Any) -> Any:
        return self.config(*args)
