"""Pool settings as a config file gives them (``kvsvc serve --config``): the values each
takes, and the message that names a bad one."""

from __future__ import annotations

import pytest

from kvsvc.server.config import ConfigError, server_config_from_dict


def pools(**settings: object) -> dict[str, object]:
    return {"pools": [{"name": "p", **settings}]}


@pytest.mark.parametrize("interval", [-1, 0, 32])
def test_every_retention_interval_vllm_takes_is_accepted(interval: int) -> None:
    """-1 caches every block of a sliding-window group (vLLM's None), 0 only the blocks
    a later hit can reach (vLLM's default), N a window tail per N tokens too."""
    config = server_config_from_dict(pools(prefix_cache_retention_interval=interval))
    assert config.pools[0].prefix_cache_retention_interval == interval


def test_a_retention_interval_below_minus_one_is_refused_naming_it() -> None:
    with pytest.raises(
        ConfigError,
        match=r"prefix_cache_retention_interval must be -1 \(every block\), 0 or a multiple "
        r"of the block size, got -2",
    ):
        server_config_from_dict(pools(prefix_cache_retention_interval=-2))
