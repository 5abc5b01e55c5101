"""kvsvc serve --hash-seed-file: the cluster's shared seed from a secret file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.cli import build_parser
from kvsvc.commands.serve import build_config
from kvsvc.server.config import ConfigError


def config_with(*flags: str) -> object:
    return build_config(build_parser().parse_args(["serve", "--pool", "p", *flags]))


def test_the_seed_comes_from_the_files_first_line(tmp_path: Path) -> None:
    path = tmp_path / "seed"
    path.write_text("# the cluster's seed\n\n  s3cret-seed  \nignored\n")
    config = config_with("--hash-seed-file", str(path))
    assert config.pools[0].hash_seed == "s3cret-seed"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "message"), [(None, "No such file"), ("# only a comment\n\n", "holds no seed")]
)
def test_a_missing_or_empty_seed_file_is_an_error_naming_the_flag(
    tmp_path: Path, text: str | None, message: str
) -> None:
    path = tmp_path / "seed"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        config_with("--hash-seed-file", str(path))
    assert "--hash-seed-file" in str(err.value)


def test_the_seed_and_its_file_exclude_each_other(tmp_path: Path) -> None:
    (tmp_path / "seed").write_text("x\n")
    result = subprocess.run(
        [
            *(sys.executable, "-m", "kvsvc", "serve", "--pool", "p", "--hash-seed", "a"),
            *("--hash-seed-file", str(tmp_path / "seed")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "not allowed with argument --hash-seed" in result.stderr


def test_a_config_files_pool_reads_its_seed_file(tmp_path: Path) -> None:
    """``hash_seed_file`` in a ``[[pools]]`` table: the seed stays out of the config file
    as the flag keeps it out of argv; with ``hash_seed`` beside it, or unreadable, the
    error names the key."""
    (tmp_path / "seed").write_text("cluster-seed\n")
    config_file = tmp_path / "pools.toml"
    config_file.write_text(f'[[pools]]\nname = "p"\nhash_seed_file = "{tmp_path / "seed"}"\n')
    config = build_config(build_parser().parse_args(["serve", "--config", str(config_file)]))
    assert config.pools[0].hash_seed == "cluster-seed"  # type: ignore[attr-defined]
    config_file.write_text(
        f'[[pools]]\nname = "p"\nhash_seed = "x"\nhash_seed_file = "{tmp_path / "seed"}"\n'
    )
    with pytest.raises(ConfigError, match=r"pools\[0\]: give hash_seed or hash_seed_file"):
        build_config(build_parser().parse_args(["serve", "--config", str(config_file)]))
    config_file.write_text(f'[[pools]]\nname = "p"\nhash_seed_file = "{tmp_path / "none"}"\n')
    with pytest.raises(ConfigError, match=r"pools\[0\]\.hash_seed_file .*none"):
        build_config(build_parser().parse_args(["serve", "--config", str(config_file)]))
