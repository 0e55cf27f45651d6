import pytest

from scheduler import Request, RequestStatus, SamplingParams, SchedulerConfig


def test_request_tracks_tokens_and_status():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_ids={0})
    assert req.all_token_ids == [1, 2, 3] and req.output_token_ids == []
    assert req.num_prompt_tokens == 3 and req.num_output_tokens == 0
    assert req.status is RequestStatus.WAITING and not req.is_finished
    assert req.finish_reason is None and req.num_cached_tokens <= 0
    assert req.extra_keys == ()
    all_ids = req.all_token_ids
    req.append_output_token(9)
    assert req.all_token_ids is all_ids  # the same list, kept in sync, not rebuilt
    assert all_ids == [1, 2, 3, 9] and req.output_token_ids == [9]
    assert req.num_output_tokens == 1 and req.num_tokens == 4
    # The caller's prompt list is copied, so appends never reach it.
    prompt = [5, 6]
    other = Request("o", prompt, SamplingParams())
    other.append_output_token(1)
    assert prompt == [5, 6] and other.prompt_token_ids == [5, 6]


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
    ],
)
def test_finish_reason(status, reason):
    req = Request("r", [1], SamplingParams())
    req.status = status
    assert req.finish_reason == reason
    assert req.is_finished == (reason is not None)


def test_cache_salt_becomes_extra_keys():
    assert Request("r", [1], SamplingParams(), cache_salt="tenant-a").extra_keys == ("tenant-a",)
    with pytest.raises(ValueError, match="cache_salt"):
        Request("r", [1], SamplingParams(), cache_salt="")
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())


def test_arrival_time_defaults_to_now_and_can_be_given():
    assert Request("r", [1], SamplingParams(), arrival_time=12.5).arrival_time == 12.5
    assert Request("r", [1], SamplingParams()).arrival_time > 0


def test_config_defaults_are_valid():
    cfg = SchedulerConfig()
    assert cfg.max_num_seqs == 256 and cfg.max_num_batched_tokens == 2048
    assert cfg.block_size == 16 and cfg.enable_prefix_caching
    assert cfg.prefix_cache_hash == "builtin"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": 2.5}, "num_blocks"),
        ({"block_size": True}, "block_size"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"prefix_cache_hash": "md5"}, "prefix_cache_hash"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_eos_is_one_frozenset_of_any_size():
    params = SamplingParams(stop_token_ids=[7])
    assert Request("r", [1], params).eos_token_ids == frozenset()
    assert Request("r", [1], params, eos_token_ids=[2]).eos_token_ids == {2}
    several = Request("r", [1], params, eos_token_ids={2, 5})
    assert several.eos_token_ids == {2, 5}
    assert isinstance(several.eos_token_ids, frozenset)
    assert several.stop_screen == {2, 5, 7}
