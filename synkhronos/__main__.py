"""``python -m synkhronos``: print an environment report; ``--check`` runs every rank once.

This is a program, so unlike the library it prints.  Exit status: 0 when the
report was printed or every check passed, 1 when a check failed.
"""

import argparse
import math
import sys


def _say(line):
    # A command-line program: its report is its output (the library itself only logs).
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


KEY_WIDTH = 20  # the report's keys, aligned across sections printed one by one


def _say_step(s):
    _say(f"{'ok  ' if s.ok else 'FAIL'}  {s.name}")
    if s.detail:
        _say(f"      {s.detail}")


def _seconds(text):
    """argparse type: a number of seconds > 0 (``inf``: no limit)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:  # nan too
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (or inf); got {text!r}")
    return value


def _ranks(text):
    """argparse type: a number of ranks >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1; got {text!r}")
    return value


def main(argv=None):
    """Print the report, or run the self-check; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m synkhronos",
        description="Report on this machine's set-up for synkhronos; with --check, fork every "
                    "rank, run a function call and each collective, and say PASS or what failed.")
    parser.add_argument("--check", action="store_true",
                        help="fork, call, run every collective and compare with NumPy")
    parser.add_argument("-n", "--n-parallel", type=_ranks, default=None,
                        help="ranks for --check (default: every usable core, or every GPU)")
    parser.add_argument("--gpu", action="store_true",
                        help="--check in GPU mode (default: CPU mode)")
    parser.add_argument("--timeout", type=_seconds, default=120.0,
                        help="seconds before --check gives up (default 120; inf: never)")
    args = parser.parse_args(argv)

    if not args.check:
        from . import doctor

        # Each section as soon as it is known: a cold cache makes some take seconds.
        for section in doctor.report_sections():
            _say(doctor.format_report([section], width=KEY_WIDTH))
        return 0
    from . import selfcheck

    _say("checking: fork every rank, then a call and each collective "
         "(the first run compiles, which can take a minute) ...")
    steps = selfcheck.check(args.n_parallel, use_gpu=True if args.gpu else False,
                            timeout=args.timeout, on_step=_say_step)
    failed = [s for s in steps if not s.ok]
    if failed:
        _say(f"FAIL: {len(failed)} of {len(steps)} steps failed: "
              + ", ".join(s.name for s in failed))
        return 1
    _say(f"PASS: {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
