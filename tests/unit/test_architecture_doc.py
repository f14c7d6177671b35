"""docs/architecture.md is checked against the code where it counts: the conditions (their number
and order), every condition reason and which condition gives it (against the decide table's
cases), the action types, and the layers' modules."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from fewerbits_api.conditions import ADAPTERS_SERVED, CONDITION_TYPES, Reason
from fewerbits_operator.base.actions import ACTION_TYPES, Action
from tests.unit.test_decide import CASES
from tests.unit.test_layers import LAYERS

DOC = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
NUMBERS = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9}
REASONS = {v for k, v in vars(Reason).items() if k.isupper()}


def section(title: str) -> str:
    return DOC.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def condition_table() -> dict[str, set[str]]:
    rows = [line for line in section("The flow").splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0]: set(re.findall(r"`([A-Za-z]+)`", cells[2]))
            for line in rows[1:] for cells in [[c.strip() for c in line.strip("|").split("|")]]}


def test_the_conditions_in_order_and_their_count():
    assert list(condition_table()) == [*CONDITION_TYPES, ADAPTERS_SERVED]
    (word,) = re.findall(r"goes through (\w+) conditions", DOC)
    assert NUMBERS[word] == len(CONDITION_TYPES)
    assert " ──► ".join(CONDITION_TYPES) in DOC


def test_every_reason_is_in_the_table_and_the_count_is_right():
    table = condition_table()
    named = set().union(*table.values())
    assert named == REASONS, (sorted(REASONS - named), sorted(named - REASONS))
    (count,) = re.findall(r"with (\d+)\s+condition reasons", DOC)
    assert int(count) == len(REASONS)


def test_each_reason_the_decide_table_expects_is_listed_under_its_condition():
    table = condition_table()
    wrong = sorted({(type_, reason) for case in CASES for type_, (_, reason) in case.conditions.items()
                    if reason not in table[type_]})
    assert wrong == []


def test_the_action_types_and_their_count():
    row = next(line for line in DOC.splitlines() if line.startswith("| decide |"))
    names = re.findall(r"`([A-Z][A-Za-z]+)`", row.split("`actions.py`:", 1)[1].split(") and events", 1)[0])
    assert names == [t.__name__ for t in ACTION_TYPES] == [t.__name__ for t in typing.get_args(Action)]
    assert f"({len(ACTION_TYPES)} action types" in row


def test_the_layers_table_names_every_module_of_the_layers_test():
    text = section("Layers and subpackages")
    listed = set(re.findall(r"`([a-z_]+(?:/[a-z_]+)?)/?`", text))
    grouped = ("planner.", "autoscaler.")  # listed as their package (autoscaler/kube_io by name)
    modules = {m.replace(".", "/") for _, mods in LAYERS for m in mods
               if m and (m == "autoscaler.kube_io" or not m.startswith(grouped))}
    assert sorted(modules - listed) == []
