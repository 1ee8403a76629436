"""A Responses turn is admitted before it reads or forks anything (issue 41: "admission
comes first, before any fork or read"). A client at its limit of streams on a replica is
refused a `previous_response_id` continuation with 429 before a single script runs in
Redis: before, the turn read the stored response, forked its session (a whole state read
and written), then met the limit and deleted the fork. Counted with Redis's own
`INFO commandstats` around the refused request."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import redis

from tests.conftest import ServerProcess

KEY = "admission-key"


@pytest.fixture(scope="module")
def server(redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    with ServerProcess(
        "shakespeare", tmp_path_factory.mktemp("admission"), redis_url, cpu_threads=1, max_tokens=1000,
        api_keys=KEY, max_streams_per_key=1, response_lease_seconds=600,
    ) as srv:  # fmt: skip
        yield srv


def scripts_run(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_a_continuation_past_the_stream_limit_is_refused_before_any_read_or_fork(server):
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    first = oa.responses.create(input="Good morrow.", temperature=0, max_output_tokens=4)
    r = redis.Redis.from_url(server.redis_url)
    # the client's one stream, held open (a long streamed response it reads no further)
    with oa.responses.create(input="A long tale.", stream=True, max_output_tokens=1000,
                             extra_body={"min_tokens": 1000}) as held:  # fmt: skip
        next(iter(held))
        before = scripts_run(r)
        with pytest.raises(openai.RateLimitError) as refused:
            oa.responses.create(input="And then?", previous_response_id=first.id, max_output_tokens=4)
        after = scripts_run(r)
    assert refused.value.status_code == 429 and "quota_exceeded" in str(refused.value.body)
    assert after - before == 0, f"{after - before} scripts ran in Redis for a refused turn"
    # once the stream has ended, the same turn runs
    done = oa.responses.create(input="And then?", previous_response_id=first.id, max_output_tokens=4)
    assert done.error is None and done.previous_response_id == first.id
