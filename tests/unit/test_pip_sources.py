"""tools/pip_sources.py: the sources pip is configured with, as the arguments `make` gives uv."""

from __future__ import annotations

from tools.pip_sources import pip_options, uv_arguments

LISTING = """\
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
install.index-url='https://mirror.example/simple'
"""


def test_pip_s_sections_are_read_in_pip_s_order() -> None:
    options = pip_options(LISTING)

    assert options["find-links"] == "/opt/wheels"  # PIP_FIND_LINKS over pip.conf
    assert options["index-url"] == "https://mirror.example/simple"  # [install] read after [global]
    assert options["extra-index-url"] == "file:///opt/pypi/simple file:///opt/pypi-more/simple"


def test_every_source_and_constraint_goes_to_uv() -> None:
    assert uv_arguments(pip_options(LISTING)) == [
        "--index-strategy", "unsafe-best-match",
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///opt/pypi/simple", "--extra-index-url", "file:///opt/pypi-more/simple",
        "--find-links", "/opt/wheels",
        "--constraint", "/etc/xdg/pip/constraints.txt"]


def test_no_configuration_leaves_uv_on_its_defaults() -> None:
    assert uv_arguments(pip_options("")) == ["--index-strategy", "unsafe-best-match"]


def test_no_index_is_passed_on() -> None:
    assert uv_arguments(pip_options("global.no-index='true'\n"))[-1] == "--no-index"
