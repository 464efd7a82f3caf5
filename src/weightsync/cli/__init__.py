"""``weightsync`` command line: plan | meta-server | demo | bench | verify | doctor | status.

Each subcommand lives in its own module under ``weightsync.cli.commands`` and is imported only
when used, so ``weightsync plan`` never imports torch.distributed or a server stack.
User errors (bad layouts, missing files, impossible configurations) print one line and
exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help)
COMMANDS = {
    "plan": ("weightsync.cli.commands.plan", "plan a sync between two layouts and print its statistics"),
    "meta-server": ("weightsync.cli.commands.meta_server", "run the standalone meta server"),
    "demo": ("weightsync.cli.commands.demo", "end-to-end sync demo: 2 trainers -> 2 inference workers"),
    "bench": ("weightsync.cli.commands.bench", "benchmark weightsync against today's baselines"),
    "verify": ("weightsync.cli.commands.verify", "compare an engine's weights with a checkpoint"),
    "doctor": ("weightsync.cli.commands.doctor", "check what works on this machine (transports, GPUs, engines)"),
    "status": ("weightsync.cli.commands.status", "every member of a job: its version, state and lag"),
}


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit status 2."""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line parser. With ``argv``, only the subcommand it names is imported (to add
    its options): ``weightsync meta-server`` must not hold torch (250 MB) for nothing."""
    chosen = next((a for a in argv if a in COMMANDS), None) if argv is not None else None
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if argv is None or name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"weightsync {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
