"""The command-line reference, docs/cli.md, generated from the CLI itself (every command's --help at 100 columns),
so it cannot drift: `make test` checks it (tests/test_docs.py).

    python scripts/cli_reference.py --write docs/cli.md     # after changing a command, an option or a help text
    python scripts/cli_reference.py --check docs/cli.md     # exit 1 when the page differs from --help
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WIDTH = 100
HEAD = """# Command-line reference

Generated from the commands' own `--help` by `python scripts/cli_reference.py --write docs/cli.md` (a test checks
it is current). Every command takes a folder or a Hugging Face Hub id (`org/name[@revision]`) where it takes a
checkpoint, prints one `error:` line and exits 2 on bad input, and writes its numbers as JSON with `--json PATH|-`.
The same functions are the Python API: `moeify.convert`, `moeify.tune`, `moeify.evaluate`, `moeify.plan`
([the quick start](../README.md)).
"""


def reference() -> str:
    import click
    import typer

    from moeify.cli.app import app

    group = typer.main.get_command(app)
    root = click.Context(group, info_name="moeify", terminal_width=WIDTH, max_content_width=WIDTH)
    parts = [HEAD, "## moeify\n", "```text\n" + group.get_help(root).rstrip() + "\n```\n"]
    for name in group.list_commands(root):
        cmd = group.get_command(root, name)
        ctx = click.Context(cmd, info_name=name, parent=root, terminal_width=WIDTH, max_content_width=WIDTH)
        parts += [f"## moeify {name}\n", "```text\n" + cmd.get_help(ctx).rstrip() + "\n```\n"]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", type=Path, help="Write the reference to this file.")
    ap.add_argument("--check", type=Path, help="Exit 1 when this file differs from the CLI's --help.")
    args = ap.parse_args()
    text = reference()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}")
    if args.check:
        if not args.check.is_file() or args.check.read_text() != text:
            print(f"{args.check} is not the CLI's --help: run python scripts/cli_reference.py --write {args.check}",
                  file=sys.stderr)
            return 1
    if not (args.write or args.check):
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
