"""The decoders built for each model, kept on the model itself so that they die with it.

A decoder holds its model (it runs it), so a `weakref.WeakKeyDictionary` from model to decoders never lets the
model go: the dictionary's value keeps its own key alive, and every model ever decoded stays in memory with its
captured programs (with the dynamo holders runtime/program_lifetime.py releases, this made one pytest process keep
every tiny model its tests built: its heap grew by about 650,000 objects per test module). Stored as an attribute
of the model, model -> decoders -> model is an ordinary reference cycle, which the garbage collector frees once
nothing else holds the model.

The attribute is a `_Book`: a copy of the model (`copy.copy`, `copy.deepcopy`, pickling) gets no decoders, since
the book knows which model it belongs to and a deep copy or an unpickled model starts with an empty one. Modules'
`state_dict`, `to()` and parameter iteration never look at plain attributes.
"""

from __future__ import annotations

import weakref
from typing import Any

_ATTRIBUTE = "_eagle31_decoders"


class _Book:
    """One model's decoders, {key: SpeculativeDecoder}, with the model it belongs to (weakly)."""

    __slots__ = ("owner", "decoders")

    def __init__(self, owner: Any = None) -> None:
        self.owner = None if owner is None else weakref.ref(owner)
        self.decoders: dict = {}

    def __deepcopy__(self, memo: dict) -> _Book:
        return _Book()                     # a deep copy of the model is another model: no decoders

    def __reduce__(self):
        return _Book, ()                   # nor an unpickled one


class DecoderRegistry:
    """The mapping model -> {key: decoder} (`generate.decoder_for`), with the dict methods its users call."""

    def _book(self, model: Any, create: bool) -> _Book | None:
        book = getattr(model, "__dict__", {}).get(_ATTRIBUTE)
        if book is not None and book.owner is not None and book.owner() is model:
            return book
        if not create:
            return None
        book = _Book(model)
        object.__setattr__(model, _ATTRIBUTE, book)      # not nn.Module.__setattr__: a plain attribute
        return book

    def setdefault(self, model: Any) -> dict:
        """The model's decoders, an empty dict to fill on first use."""
        return self._book(model, create=True).decoders

    def get(self, model: Any, default: Any = None) -> Any:
        book = self._book(model, create=False)
        return default if book is None else book.decoders

    def __getitem__(self, model: Any) -> dict:
        book = self._book(model, create=False)
        if book is None:
            raise KeyError(model)
        return book.decoders

    def pop(self, model: Any, *default: Any) -> Any:
        """The model's decoders, forgotten (the next `decoder_for` builds afresh, as in a new process)."""
        book = self._book(model, create=False)
        if book is None:
            if default:
                return default[0]
            raise KeyError(model)
        decoders, book.decoders = book.decoders, {}
        delattr(model, _ATTRIBUTE)
        return decoders
