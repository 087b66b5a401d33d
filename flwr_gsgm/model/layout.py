"""The model by array name: which arrays the server rule trains, which are buffers.

A Flower model is an ``ArrayRecord`` of named arrays of any dtype; for PyTorch,
``ArrayRecord(model.state_dict())``, which holds the trainable parameters and the
buffers (BatchNorm ``running_mean``, ``running_var`` and the 0-d int64
``num_batches_tracked``). The server rules of :mod:`flwr_gsgm.core` work on one flat
float32 buffer of the **trainable** parameters only; :class:`ModelLayout` splits a
model into

- trainable arrays (float32): the rule steps them (momentum, learning rate);
- buffers (every other array): never stepped; :class:`~flwr_gsgm.model.buffers.ModelBuffers`
  averages the floating ones over the nodes' latest reports and keeps the integer
  ones as the latest report has them (dtype and shape unchanged).

Which keys are trainable: by default the floating-point arrays whose name's last
dotted part is not one of :data:`BUFFER_NAMES`; or an explicit list, e.g.
``[name for name, _ in model.named_parameters()]``.

Replies are matched by **name**, never by position: a reply may list the arrays in
any order; one with a key the model does not have, without a trainable key, or with
an array of another dtype or shape than the model's is rejected, and the message
names the key. A reply may leave out a buffer (a gradient-mode client that sends
``named_parameters()`` only): that node then reports nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord

from flwr_gsgm.core import REASONS, UpdateRejected

__all__ = ["BUFFER_NAMES", "ArraySpec", "ModelLayout", "ModelUpdate", "looks_like_buffer"]

#: Last dotted parts of the names PyTorch gives to BatchNorm's (and InstanceNorm's)
#: buffers: never trainable by default.
BUFFER_NAMES = ("running_mean", "running_var", "num_batches_tracked")

_F32 = np.dtype(np.float32)


def looks_like_buffer(key: str) -> bool:
    """True if the last dotted part of ``key`` is one of :data:`BUFFER_NAMES`."""
    return key.rsplit(".", 1)[-1] in BUFFER_NAMES


def _reject(reason: str, message: str) -> UpdateRejected:
    assert reason in REASONS, reason  # one list of reasons (flwr_gsgm.core.REASONS)
    return UpdateRejected(reason, message)


@dataclass(frozen=True)
class ArraySpec:
    """One named array of the model: its shape, dtype and whether the rule trains it."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    trainable: bool


@dataclass
class ModelUpdate:
    """One accepted reply, split by the layout.

    ``trainable``: float32 arrays in :attr:`ModelLayout.trainable_keys` order (a
    gradient or a displacement: what the core rule steps against). ``buffers``:
    the buffer values the node reported, by key (a subset of
    :attr:`ModelLayout.buffer_keys`; values, not updates), dtypes and shapes the model's.
    """

    trainable: list[np.ndarray]
    buffers: dict[str, np.ndarray]


class ModelLayout:
    """The named arrays of a model and which of them are trainable.

    Parameters
    ----------
    specs : sequence of ArraySpec
        The model's arrays in model order (the order of the initial ``ArrayRecord``).

    Raises
    ------
    ValueError
        If no array is trainable, a key repeats, or a trainable array is not float32
        (the message names the key and says what to change).
    """

    def __init__(self, specs: Sequence[ArraySpec]) -> None:
        self.specs = tuple(specs)
        self.keys = [s.key for s in self.specs]
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"model array keys repeat: {self.keys}")
        self.by_key = {s.key: s for s in self.specs}
        self.trainable_keys = [s.key for s in self.specs if s.trainable]
        self.buffer_keys = [s.key for s in self.specs if not s.trainable]
        if not self.trainable_keys:
            raise ValueError(
                f"the model has no trainable array (keys {self.keys[:6]}...): pass "
                "trainable_keys, e.g. [name for name, _ in model.named_parameters()]"
            )
        for spec in self.specs:
            if spec.trainable and spec.dtype != _F32:
                raise ValueError(
                    f"trainable array {spec.key!r} has dtype {spec.dtype}; the server rules "
                    "work in float32: cast the model (model.float()) or, if it is not a "
                    "parameter, leave it out of trainable_keys"
                )
        self._trainable_index = [i for i, s in enumerate(self.specs) if s.trainable]

    @classmethod
    def from_arrays(
        cls,
        keys: Sequence[str],
        arrays: Sequence[np.ndarray],
        trainable_keys: Iterable[str] | None = None,
    ) -> ModelLayout:
        """The layout of ``arrays`` under ``keys``; trainable: ``trainable_keys`` or the default.

        Raises
        ------
        ValueError
            If ``trainable_keys`` names a key the model does not have (the message
            lists it and the model's keys), or as :class:`ModelLayout`.
        """
        if trainable_keys is None:
            chosen = {
                k for k, a in zip(keys, arrays) if a.dtype.kind == "f" and not looks_like_buffer(k)
            }
        else:
            chosen = set(trainable_keys)
            unknown = sorted(chosen - set(keys))
            if unknown:
                raise ValueError(
                    f"trainable_keys names {unknown}, which the model does not have; "
                    f"its keys are {list(keys)}"
                )
        return cls(
            [
                ArraySpec(k, tuple(a.shape), np.dtype(a.dtype), k in chosen)
                for k, a in zip(keys, arrays)
            ]
        )

    @classmethod
    def from_record(
        cls, record: ArrayRecord, trainable_keys: Iterable[str] | None = None
    ) -> tuple[ModelLayout, list[np.ndarray]]:
        """The layout of ``record`` and its arrays (model order, dtypes kept).

        Raises
        ------
        ValueError
            As :meth:`from_arrays`.
        """
        keys = list(record.keys())
        arrays = [record[k].numpy() for k in keys]
        return cls.from_arrays(keys, arrays, trainable_keys), arrays

    # ------------------------------------------------------------- split / join
    def trainable_of(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The trainable arrays of a model-ordered list (no copy)."""
        return [arrays[i] for i in self._trainable_index]

    def buffers_of(self, arrays: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """The buffers of a model-ordered list, by key (no copy)."""
        return {s.key: a for s, a in zip(self.specs, arrays) if not s.trainable}

    def join(
        self, trainable: Sequence[np.ndarray], buffers: dict[str, np.ndarray]
    ) -> list[np.ndarray]:
        """The model-ordered list of ``trainable`` (trainable order) and ``buffers`` (no copy)."""
        it = iter(trainable)
        return [next(it) if s.trainable else buffers[s.key] for s in self.specs]

    # ------------------------------------------------------------------ replies
    def match(self, record: ArrayRecord) -> ModelUpdate:
        """Match a reply's arrays to the model by name; return them split.

        The trainable arrays are returned as received (the update, before any
        client-mode conversion); each array's dtype and shape must be the model's.

        Raises
        ------
        UpdateRejected
            ``"array-keys"``: a key the model does not have, or a trainable key
            missing; ``"array-format"``: an array that cannot be decoded;
            ``"dtype"`` / ``"shape"``: an array whose dtype / shape differs from the
            model's; ``"non-finite"``: a floating buffer with NaN or infinity. The
            message names the key.
        """
        received = list(record.keys())
        extra = [k for k in received if k not in self.by_key]
        if extra:
            raise _reject(
                "array-keys",
                f"reply has array(s) {extra} the model does not have (model keys: {self.keys})",
            )
        missing = [k for k in self.trainable_keys if k not in record]
        if missing:
            raise _reject("array-keys", f"reply lacks trainable array(s) {missing}")
        arrays = {k: self._decoded(k, record) for k in received}
        buffers = {k: arrays[k] for k in self.buffer_keys if k in arrays}
        for key, arr in buffers.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise _reject("non-finite", f"buffer {key!r} holds NaN or infinity")
        return ModelUpdate([arrays[k] for k in self.trainable_keys], buffers)

    def _decoded(self, key: str, record: ArrayRecord) -> np.ndarray:
        spec = self.by_key[key]
        try:
            arr = record[key].numpy()
        except Exception as err:  # a corrupt payload must not stop the run
            raise _reject("array-format", f"array {key!r} cannot be decoded: {err}") from err
        if arr.dtype != spec.dtype:
            raise _reject(
                "dtype", f"array {key!r} has dtype {arr.dtype}, the model's is {spec.dtype}"
            )
        if tuple(arr.shape) != spec.shape:
            raise _reject(
                "shape",
                f"array {key!r} has shape {tuple(arr.shape)}, the model's is {spec.shape}",
            )
        return arr
