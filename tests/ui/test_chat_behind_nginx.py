"""The chat page through the nginx of docker/ (two mock replicas, scripts/local_cluster.py): the
answer streams in unbuffered, and Stop's DELETE reaches the replica that holds the request."""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.conftest import REPLICA_IDS
from tests.ui.chat_page import ChatPage
from tests.ui.conftest import metric_sample, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(browser, idle_cluster):
    """The session's idle cluster (``tests/conftest.py``): this test leaves no request running."""
    return idle_cluster


def running_on(replica_url: str) -> float:
    body = httpx.get(f"{replica_url}/metrics", timeout=5).text
    return metric_sample(body, "slotserve_requests_running")


def test_stream_and_stop_through_nginx(cluster, browser):
    page = ChatPage(browser, cluster.url)
    page.open()
    assert page.text("#model") == "mock-bytes"
    page.set_setting("max_completion_tokens", "3000")  # 60 s at 20 ms a step
    page.set_setting("ignore_eos", True)
    page.watch_answers()
    page.type_and_press_enter("hello through nginx")
    page.wait(lambda d: len(set(page.seen_answer_texts())) >= 6, "partial answers arrive")
    answer = page.answers()[-1]
    request_id = answer.get_attribute("data-request-id")
    replica = request_id.partition("-")[0]  # server-made ids name their replica
    assert replica in REPLICA_IDS
    assert running_on(cluster.replicas[replica]) == 1

    page.click("#stop")

    page.wait(lambda d: answer.get_attribute("data-state") == "stopped", "the answer stopped")
    assert page.stat(answer, "finish") == "cancelled"  # the DELETE reached the owner
    for url in cluster.replicas.values():
        wait_until(lambda url=url: running_on(url) == 0, what=f"{url} has no request running")
    assert page.browser_problems() == []
