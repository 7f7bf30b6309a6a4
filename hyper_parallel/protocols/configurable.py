"""Configurable: a class whose constructor takes one nested ``Config`` dataclass.

``Foo.Config(...)`` holds every constructor argument as data; ``Foo.Config(...).build()``
constructs ``Foo(config)``. A subclass that does not declare its own ``Config`` gets a
fresh (empty) subclass of its parent's, so ``Sub.Config(...).build()`` builds ``Sub``,
never the parent.

Configs are ``kw_only`` + ``slots`` dataclasses so that a misspelled field is an error
at construction time rather than a silently ignored attribute.
"""

from dataclasses import dataclass, fields
from typing import Any

from hyper_parallel.protocols.config_dict import config_from_dict, config_to_dict, value_from_data, value_to_data


class Configurable:
    @dataclass(kw_only=True, slots=True)
    class Config:
        def build(self, **kwargs: Any) -> Any:
            owner = getattr(type(self), "_owner", None)
            if owner is None:
                raise TypeError(f"{type(self).__qualname__} has no owner class to build")
            return owner(self, **kwargs)

        def to_dict(self) -> dict:
            return config_to_dict(self)

        @classmethod
        def from_dict(cls, data: dict) -> "Configurable.Config":
            config = config_from_dict(data)
            if not isinstance(config, cls):
                raise TypeError(
                    f"{cls.__qualname__}.from_dict: the dict describes {type(config).__qualname__}, "
                    f"not a {cls.__qualname__}")
            return config

        def _fields_to_data(self) -> dict:
            """Every field as plain data: what ``config_to_dict`` writes after ``_target_``.
            The config owns its encoding, so the serializer needs no config class; a
            config holding something other than data overrides this (``Function.Config``)."""
            return {f.name: value_to_data(getattr(self, f.name), f"{type(self).__qualname__}.{f.name}")
                    for f in fields(self)}

        @classmethod
        def _from_data_fields(cls, data: dict) -> "Configurable.Config":
            """The inverse of ``_fields_to_data``: ``data`` is the dict less its ``_target_``."""
            return cls(**{name: value_from_data(value) for name, value in data.items()})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Config" not in cls.__dict__:
            cls.Config = _derived_config(cls)
        cls.Config._owner = cls

    def __init__(self, config: "Configurable.Config") -> None:
        if not isinstance(config, type(self).Config):
            raise TypeError(
                f"{type(self).__qualname__} expects a {type(self).Config.__qualname__}, "
                f"got {type(config).__qualname__}")
        self.config = config


Configurable.Config._owner = None


def _derived_config(cls: type) -> type:
    """An empty Config subclass owned by ``cls`` (named ``cls.Config`` for serialization)."""
    parent = cls.Config
    namespace = {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}.Config"}
    return dataclass(kw_only=True, slots=True)(type("Config", (parent,), namespace))
