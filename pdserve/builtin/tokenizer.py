"""The built-in models' tokenizer: a byte-level BPE with Llama-3-style special tokens
and chat template, trained on `pdserve.builtin.corpus` (the random-weight model) or on the story
corpus (the trained models; `pdserve.builtin.train`). Deterministic: two trainings on the
same text give the same `tokenizer.json`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.builtin.corpus import corpus_text

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
# Trained first, so they get ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)

CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "    {{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- (messages[0]['content'] | trim) + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n\\nYou may call one or more functions. Their signatures are within"
    " <tools></tools>:\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' + (tool | tojson) }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and"
    " arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>,"
    " \"arguments\": <args-json-object>}\\n</tool_call><|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('Unsupported chat role: ' + message['role']"
    " + ' (expected system, user, assistant or tool)') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'tool' %}\n"
    "        {{- '<|start_header_id|>tool<|end_header_id|>\\n\\n<tool_response>\\n'"
    " + (message['content'] | trim) + '\\n</tool_response><|eot_id|>' }}\n"
    "    {%- elif not (tools and loop.first and message['role'] == 'system') %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] | trim) }}\n"
    "        {%- for call in message['tool_calls'] or [] %}\n"
    "            {%- set args = call['function']['arguments'] %}\n"
    "            {{- '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (args if args is string else args | tojson) + '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|eot_id|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def train_tokenizer(vocab_size: int = 2048, texts: Iterable[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE on `texts` (default: `pdserve.builtin.corpus`'s sections)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte is in the vocabulary, so any text (any language, emoji) encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(
        corpus_text().split("\n\n") if texts is None else texts, trainer=trainer
    )
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Like Llama 3: encode(add_special_tokens=True) prepends BOS.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tok


def special_ids(tok: Tokenizer) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert all(v is not None for v in ids.values()), ids
    return ids  # type: ignore[return-value]


def tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: special tokens, the chat template, the length limit."""
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "pad_token": END_OF_TEXT_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        # Keep decode exactly what tokenizer.json's decoder produces.
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
