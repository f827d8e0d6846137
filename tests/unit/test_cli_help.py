"""Every option and argument of every ``aggnet`` command says what it is
for: a user reads ``--help``, not the source."""

from __future__ import annotations

import argparse

from aggnet.cli.main import build_parser


def _walk(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_and_argument_has_help():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _walk(build_parser(), "aggnet")
               if not (a.help and a.help.strip()) and a.help != argparse.SUPPRESS]
    assert not missing, f"no help text: {missing}"


def test_the_heartbeat_lapse_help_says_the_hosts_default():
    """The command line does not import the host (numba) to print its
    help, so the default is written there too: the two must agree."""
    from aggnet.hosts.switch import DEFAULT_HEARTBEAT_LAPSE

    lapse = next(a for path, a in _walk(build_parser(), "aggnet") if "--heartbeat-lapse" in a.option_strings)
    assert lapse.help.endswith(f"default {DEFAULT_HEARTBEAT_LAPSE:g}"), lapse.help
