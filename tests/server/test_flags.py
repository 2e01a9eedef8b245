import dataclasses

import pytest

from server.app import build_parser
from server.config import ServerConfig, flag_name
from server.flags import config_from_args


def test_every_server_config_field_is_a_flag_whose_value_reaches_the_config(tmp_path):
    parser = build_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    fields = [f.name for f in dataclasses.fields(ServerConfig)]
    assert [name for name in fields if flag_name(name) not in flags] == []
    args = parser.parse_args(
        [
            "--capacity", "512MiB", "--reap-interval", "0.5", "--max-unauthenticated", "7",
            "--metadata-only", "--pool", "disk", "--pool-dir", str(tmp_path),
        ]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.capacity_bytes == 512 << 20 and config.reap_interval_s == 0.5
    assert config.max_unauthenticated == 7 and config.metadata_only
    assert config.pool_medium == "disk" and config.pool_dir == tmp_path
    assert config_from_args(parser.parse_args([])) == ServerConfig()


def test_a_bad_flag_value_names_its_flag():
    parser = build_parser()
    with pytest.raises(ValueError, match="--port: cannot use 'x' as int"):
        config_from_args(parser.parse_args(["--port", "x"]))
    with pytest.raises(ValueError, match="--prefault '2 lots'"):
        config_from_args(parser.parse_args(["--prefault", "2 lots"]))
