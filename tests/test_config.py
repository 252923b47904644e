"""Config files: the CLI's knobs, with unknown keys named."""

from __future__ import annotations

import pytest

from servekit import BatchingPolicy, QueuePolicy, TimeoutAction
from servekit.config import load_config, policy_from_dict


def test_toml_config_round_trips_to_a_policy(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(
        """
model = "resnet50"
instances = 2
[server]
http_port = 9000
[batching]
max_batch_size = 16
preferred_batch_sizes = [4, 8]
max_queue_delay_us = 500
[batching.queue]
max_queue_size = 64
timeout_action = "DELAY"
default_timeout_us = 1000
"""
    )
    data = load_config(path)
    assert data["server"]["http_port"] == 9000 and data["instances"] == 2
    assert policy_from_dict(data["batching"]) == BatchingPolicy(
        max_batch_size=16,
        preferred_batch_sizes=(4, 8),
        max_queue_delay_us=500,
        default_queue_policy=QueuePolicy(
            max_queue_size=64, default_timeout_us=1000, timeout_action=TimeoutAction.DELAY
        ),
    )


def test_yaml_config(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny_cnn\nbatching:\n  max_batch_size: 4\n")
    assert policy_from_dict(load_config(path)["batching"]).max_batch_size == 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("modle = 'x'", r"unknown key\(s\) \['modle'\] in \[top level\]"),
        ("[server]\nhttp = 1", r"unknown key\(s\) \['http'\] in \[server\]"),
        ("[batching]\nmax_batch = 1", r"unknown key\(s\) \['max_batch'\] in \[batching\]"),
        ("[batching.queue]\nsize = 1", r"unknown key\(s\) \['size'\] in \[batching.queue\]"),
        ("[batching]\nmax_queue_delay_us = -1", "max_queue_delay_us must be >= 0, got -1"),
    ],
)
def test_bad_config_files_name_the_bad_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_other_file_types_are_refused(tmp_path):
    path = tmp_path / "serve.ini"
    path.write_text("")
    with pytest.raises(ValueError, match=r"\.toml, \.yaml or \.yml"):
        load_config(path)
