"""The known-harmless messages of dependencies are hidden; anything else still shows."""

from __future__ import annotations

import logging
import warnings

import pytest

from freetx.noise import quiet_known_noise


@pytest.fixture
def records(caplog):
    quiet_known_noise()
    caplog.set_level(logging.DEBUG)
    return caplog


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_known_torchao_and_pytree_lines_are_dropped(records):
    logging.getLogger("torchao").warning(
        "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
        "Could not load this library"
    )
    logging.getLogger("torch.utils._pytree").warning(
        "%s is an Enum subclass and is now natively supported by torch.compile",
        "<enum 'KernelPreference'>",
    )
    assert _messages(records) == []


def test_other_messages_of_the_same_loggers_still_show(records):
    logging.getLogger("torchao").warning("Failed to load /venv/torchao/_C_new_kernel.so: x")
    logging.getLogger("torchao").warning("Skipping import of cpp extensions")
    logging.getLogger("torch.utils._pytree").warning(
        "%s is an Enum subclass and is now natively supported", "<enum 'OtherEnum'>"
    )
    assert len(_messages(records)) == 3


def test_an_unknown_warning_still_shows():
    quiet_known_noise()
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`torch.distributed.new_thing` is deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("something new", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "`torch.distributed.new_thing` is deprecated.",
        "something new",
    ]
