"""Regenerate the `--help` blocks of README.md and docs/*.md from the real command line: `make readme`
(`python -m tests.readme_help`).

tests/test_cli.py fails when they drift; this rewrites them. The command-line reference,
docs/reference/cli.md, needs none: mkdocs-click generates it from the commands themselves.
"""

from __future__ import annotations

import re

from click.testing import CliRunner

from govtrain.cli.main import cli
from govtrain.cli.verify import verify_cli
from tests.conftest import REPO

BLOCK = re.compile(r"```text\n\$ (govtrain[^\n]*?) --help\n(.*?)\n```", re.S)


def real_help(command: str) -> str:
    words = command.split()
    program = verify_cli if words[0] == "govtrain-verify" else cli
    result = CliRunner().invoke(program, [*words[1:], "--help"], prog_name=words[0])
    assert result.exit_code == 0, result.output
    return result.stdout.rstrip()


def pages() -> list:
    """The Markdown files that may hold `--help` blocks."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def main() -> None:
    for path in pages():
        text = path.read_text()
        new = BLOCK.sub(lambda m: f"```text\n$ {m.group(1)} --help\n{real_help(m.group(1))}\n```", text)
        if new != text:
            path.write_text(new)
            print(f"{path.relative_to(REPO)}: help blocks regenerated")


if __name__ == "__main__":
    main()
