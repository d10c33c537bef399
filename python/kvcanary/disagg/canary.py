"""The canary as each role sees it (engine hooks, transfer buffers, attributed violations) and the transfer layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvcanary_schema import Group, Stage

from kvcanary.adapter import TransferBuffer, check_transfer_buffers
from kvcanary.engine.engine import Engine
from kvcanary.engine.hooks import EngineHooks
from kvcanary.errors import CanaryInputError
from kvcanary.report import Violation

from .layout import TransferItem, TransferLayout


class CanaryBinding(Protocol):
    """An installed canary on one role's engine."""

    @property
    def hooks(self) -> EngineHooks:
        """Hooks to hand to the engine."""
        ...

    def transfer_buffers(self) -> Sequence[TransferBuffer]:
        """The canary record buffers that travel with the KV."""
        ...

    def poll(self, final: bool) -> list[Violation]:
        """Violations found since the last poll, attributed to request ids (``final``: flush everything)."""
        ...


def canary_items(buffers: Sequence[TransferBuffer]) -> list[TransferItem]:
    """Transfer items of the canary buffers, named ``<prefix>.<group>.<stage>`` by the runtime."""
    check_transfer_buffers(buffers)
    out = []
    for name, tensor in buffers:
        parts = name.split(".")
        try:
            group, stage = Group[parts[-2].upper()], Stage[parts[-1].upper()]
        except (IndexError, KeyError) as err:
            raise CanaryInputError(f"transfer buffer {name!r}: expected '<prefix>.<group>.<stage>'") from err
        if stage not in (Stage.HEAD, Stage.TAIL):
            raise CanaryInputError(f"transfer buffer {name!r}: stage must be HEAD or TAIL")
        out.append(TransferItem(name, tensor, group, True, stage=stage))
    return out


def engine_layout(engine: Engine, canary: CanaryBinding | None) -> TransferLayout:
    """HEAD records, then every layer's K and V (FULL or SWA pool), then TAIL records (the stream's last items)."""
    view = engine.pool_view()
    kv = []
    for layer, (k, v) in enumerate(zip(view.k, view.v, strict=True)):
        group = Group.SWA if layer in view.swa_layers else Group.FULL
        kv += [TransferItem(f"kv.k{layer}", k, group, False, layer),
               TransferItem(f"kv.v{layer}", v, group, False, layer)]
    records = canary_items(canary.transfer_buffers()) if canary is not None else []
    head = [i for i in records if i.stage == Stage.HEAD]
    tail = [i for i in records if i.stage == Stage.TAIL]
    return TransferLayout([*head, *kv, *tail])
