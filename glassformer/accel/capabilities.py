"""What each fast path computes, field by field of `ModelConfig`: its capability table.

A fast path that silently computes something other than the model is the worst bug a glass
box can have. So each one declares, for every config field, either any value or the values
it computes, with the reason; `CapabilityTable.why_not(config)` names the first field whose
value it does not compute, and the caller takes the module path. A field a table does not
list is refused too (tests/accel/test_capabilities.py fails on it first), so a new field
cannot slip past a fast path.

The tables sit beside their fast paths:
- the fused C++ decode step: `fast_decode.CAPABILITIES`;
- training's fused passes: `fast_training.CAPABILITIES`;
- the quantized linear kernels: `quantize.CAPABILITIES`;
- the serving engine's paged attention declares its own with this type, in serving/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """The values of one field a fast path computes: `values` None for any value."""

    values: frozenset | None
    reason: str

    def accepts(self, value: Any) -> bool:
        return self.values is None or value in self.values


def any_value(reason: str = "") -> Rule:
    """Every value of the field is computed (the reason says where, when not obvious)."""
    return Rule(None, reason)


def only(*values: Any, reason: str) -> Rule:
    """Only these values are computed; `reason` says what the others would need."""
    return Rule(frozenset(values), reason)


@dataclass(frozen=True)
class CapabilityTable:
    """One fast path's rules, by `ModelConfig` field name."""

    name: str  # the fast path, as a message names it: "fused decode step"
    rules: Mapping[str, Rule]

    def refused_field(self, config: ModelConfig) -> str | None:
        """The first field whose value this path does not compute (or that it does not
        classify), or None when it computes `config`."""
        for field in dataclasses.fields(config):
            rule = self.rules.get(field.name)
            if rule is None or not rule.accepts(getattr(config, field.name)):
                return field.name
        return None

    def why_not(self, config: ModelConfig) -> str | None:
        """One line naming the first field whose value this path does not compute, or None."""
        field = self.refused_field(config)
        if field is None:
            return None
        rule, value = self.rules.get(field), getattr(config, field)
        if rule is None:
            return f"{self.name}: {field} is not classified, so not computed"
        return f"{self.name}: {field}={value!r} is not computed ({rule.reason})"

    def unclassified(self) -> list[str]:
        """The `ModelConfig` fields this table has no rule for."""
        return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in self.rules]

    def refused(self) -> dict[str, Rule]:
        """The rules that limit a field's values."""
        return {name: rule for name, rule in self.rules.items() if rule.values is not None}
