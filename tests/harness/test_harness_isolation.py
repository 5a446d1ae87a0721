"""The harness keeps to itself: what it sets up applies to its own processes only.

Installing the package loads the plugin into every pytest session of the environment, so
the plugin must not change another project's process: ``os.environ`` included. The DNS
workaround (``RES_OPTIONS=use-vc``, see ``rendezvous.avoid_reverse_dns_stalls``) goes to the
ranks, and into the C environment of the process that runs them once it starts a store.
"""

from __future__ import annotations

pytest_plugins = ["pytester"]

# A stranger's project: only the installed package, no conftest.
DNS_TESTS = """
import ctypes
import os

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p


def resolver_options(rank, world_size):
    return os.environ.get("RES_OPTIONS")


def test_installing_the_plugin_changes_nothing():
    assert "RES_OPTIONS" not in os.environ


def test_ranks_get_the_workaround_and_os_environ_stays_as_it_was(run_ranks):
    assert run_ranks(resolver_options) == ["use-vc", "use-vc"]
    assert "RES_OPTIONS" not in os.environ
    # ... but glibc's resolver in this process, which hosts the store, reads it.
    assert libc.getenv(b"RES_OPTIONS") == b"use-vc"


def test_a_users_own_setting_wins(run_ranks, monkeypatch):
    monkeypatch.setenv("RES_OPTIONS", "attempts:1")
    assert run_ranks(resolver_options) == ["attempts:1", "attempts:1"]
"""


def test_the_dns_workaround_reaches_the_ranks_and_nothing_else(pytester, monkeypatch):
    monkeypatch.delenv("RES_OPTIONS", raising=False)  # our root conftest sets it for us
    pytester.makepyfile(DNS_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=3)
