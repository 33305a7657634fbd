"""`LaunchSandbox.check()`: a setting the machine cannot honour is refused at start-up with one line naming it."""

from __future__ import annotations

import os

import pytest

from gyre_sched.sandbox import LaunchSandbox


def test_a_missing_runtime_is_named():
    with pytest.raises(RuntimeError, match="'no-such-runtime' not found"):
        LaunchSandbox(runtime="oci", oci_runtime="no-such-runtime").check()
    with pytest.raises(RuntimeError, match="bubblewrap"):
        LaunchSandbox(bwrap="no-such-bwrap").check()


def test_the_oci_runtime_without_root_is_refused_before_any_execution(monkeypatch):
    sandbox = LaunchSandbox(runtime="oci", oci_runtime="/bin/true")
    if os.geteuid() == 0:
        sandbox.check()  # root: accepted
    # Another user (the project's venv lives under root's home, so a real drop of privileges cannot run Python
    # here): the effective uid is what the check reads.
    monkeypatch.setattr(os, "geteuid", lambda: 65534)
    with pytest.raises(RuntimeError) as refused:
        sandbox.check()
    assert str(refused.value) == (
        "the OCI execution sandbox needs root (euid is 65534): run gyre as root, or use "
        'sandbox_runtime = "bubblewrap" (unprivileged user namespaces)'
    )
    LaunchSandbox().check()  # bubblewrap runs unprivileged: no such requirement
