"""tools/render_dashboard.py: template.yaml carries dashboard.json, exactly, as PipelineDashboard's body."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from samtranslator.yaml_helper import yaml_parse

from tools.render_dashboard import BEGIN, END, WIDTH, layout, main, render

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = (REPO / "template.yaml").read_text()
DASHBOARD = json.loads((REPO / "dashboard.json").read_text())
SMALL = f"""Resources:
  Board:
    Type: AWS::CloudWatch::Dashboard
    Properties:
      DashboardName: board
{BEGIN}
      DashboardBody: "stale"
{END}
  After:
    Type: AWS::SNS::Topic
"""


def dashboard_body(template: str) -> str:
    (board,) = [r for r in yaml_parse(template)["Resources"].values() if r["Type"] == "AWS::CloudWatch::Dashboard"]
    return board["Properties"]["DashboardBody"]["Fn::Sub"]


def test_template_yaml_carries_dashboard_json_as_rendered() -> None:
    # a failure here: dashboard.json or the copy in template.yaml was edited alone; run tools/render_dashboard.py
    assert render(TEMPLATE, DASHBOARD) == TEMPLATE


def test_the_template_s_dashboard_body_is_the_file_s_json() -> None:
    assert json.loads(dashboard_body(TEMPLATE)) == DASHBOARD


def test_render_replaces_only_what_lies_between_the_markers() -> None:
    rendered = render(SMALL, {"widgets": [{"type": "text", "x": 0, "properties": {"markdown": "${AWS::Region}"}}]})

    assert json.loads(dashboard_body(rendered)) == {"widgets": [{"type": "text", "x": 0,
                                                                 "properties": {"markdown": "${AWS::Region}"}}]}
    assert yaml_parse(rendered)["Resources"]["After"] == {"Type": "AWS::SNS::Topic"}
    assert rendered.startswith(SMALL.split(BEGIN)[0] + BEGIN + "\n") and rendered.endswith(END + SMALL.split(END)[1])
    assert render(rendered, DASHBOARD) == render(SMALL, DASHBOARD)  # rendering again starts from the markers


@pytest.mark.parametrize("template", [SMALL.replace(BEGIN + "\n", ""), SMALL.replace(END + "\n", ""),
                                      SMALL.replace(BEGIN, END + "\n" + BEGIN).replace(END + "\n  After", "  After")])
def test_a_template_without_both_markers_in_order_is_refused(template: str) -> None:
    with pytest.raises(ValueError, match="BEGIN dashboard.json"):
        render(template, DASHBOARD)


def test_layout_packs_members_into_lines_of_the_width_and_keeps_long_strings_whole() -> None:
    value = {"rows": [["a" * 10, "b" * 10], ["c" * 10, {"label": "d" * 10}]], "title": "t", "long": "x" * 60}

    text = layout(value, width=40)

    # lists of lists or objects: one member a line; a member that needs several lines ends the line
    assert text == ('{\n'
                    '  "rows": [\n'
                    '    ["aaaaaaaaaa", "bbbbbbbbbb"],\n'
                    '    ["cccccccccc",\n'
                    '      {"label": "dddddddddd"}]],\n'
                    '  "title": "t",\n'
                    '  "long": "' + "x" * 60 + '"}\n')
    assert json.loads(text) == value
    assert layout({"a": [1, 2]}) == '{"a": [1, 2]}\n'


def test_the_rendered_body_keeps_to_the_width_but_for_long_strings() -> None:
    body = dashboard_body(render(SMALL, DASHBOARD)).splitlines()

    assert [line for line in body if len(line) + 8 > WIDTH and '"expression": ' not in line] == []


def test_check_exits_1_when_the_template_differs_and_writing_makes_it_pass(tmp_path: Path) -> None:
    template, dashboard = tmp_path / "template.yaml", tmp_path / "dashboard.json"
    template.write_text(SMALL)
    dashboard.write_text(json.dumps(DASHBOARD))
    paths = ["--template", str(template), "--dashboard", str(dashboard)]

    assert main(["--check", *paths]) == 1 and template.read_text() == SMALL
    assert main(paths) == 0 and main(["--check", *paths]) == 0
    assert json.loads(dashboard_body(template.read_text())) == DASHBOARD
