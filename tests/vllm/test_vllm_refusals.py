"""What vLLM on kvsvc refuses at start, and why: the speculative-decoding cases its pool
does not model (the EAGLE cases also run end to end in ``test_scheduler_harness.py``)."""

from __future__ import annotations

from kvsvc.integrations.vllm.scheduler import eagle_refusal


def test_eagle_is_served_once_its_block_handling_is_off() -> None:
    assert eagle_refusal(False, 0, 1) == ""  # EAGLE reads one token ahead: exact
    assert eagle_refusal(False, 0, 0) == ""  # no EAGLE at all


def test_each_block_handling_is_named_with_the_settings_that_turn_it_off() -> None:
    dropping = eagle_refusal(True, 0, 1)
    assert "drops the last block of every prefix-cache hit" in dropping
    lookahead = eagle_refusal(False, 1, 1)
    assert "hashes blocks with the 1 token(s) after them" in lookahead
    for message in (dropping, lookahead):
        assert '"disable_eagle_block_drop": true' in message
        assert '"disable_lookahead_block_hashes": true' in message


def test_multi_module_mtp_is_refused() -> None:
    """Three MTP modules: vLLM re-prefills each request's last two tokens and caches them
    later, whatever the drop and lookahead settings say."""
    message = eagle_refusal(False, 0, 3)
    assert "multi-module MTP" in message and "last 2 tokens" in message
