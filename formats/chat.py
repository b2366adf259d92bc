"""Chat formatting: a conversation rendered with the checkpoint's own chat template, the way Hugging
Face's apply_chat_template renders it, so that a fine-tune's format is the one it was trained on.

run.py --chat and bench.py's Spec-Bench prompts both come through chat_prompt. A checkpoint without
a template falls back to its family's known format (Ouro: ChatML; Huginn: its header format), but
only when its tokenizer has that format's special tokens; else there is no chat format, and asking
for one is an error.
"""
import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# the families' formats (README, "Real checkpoints"), written as templates so that one path renders
# every format
FAMILY_TEMPLATES = {
    "ouro": ("{% for m in messages %}"
             "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
             "{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|im_start|>assistant\\n' }}{% endif %}",
             ("<|im_start|>", "<|im_end|>")),
    "huginn": ("<|begin_text|>{% for m in messages %}"
               "{{ '<|begin_header|>' + ('Huginn' if m['role'] == 'assistant' else m['role'])"
               " + '<|end_header|>\\n\\n' + m['content'] | trim + '<|end_turn|>' }}{% endfor %}"
               "{% if add_generation_prompt %}"
               "{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% endif %}",
               ("<|begin_text|>", "<|begin_header|>", "<|end_header|>", "<|end_turn|>")),
}
END_OF_TURN = ("<|im_end|>", "<|end_turn|>")  # Ouro's and Huginn's: an answer ends there
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
           "mask_token")


class GenerationBlock(Extension):
    """Hugging Face's {% generation %}...{% endgeneration %} (Huginn's template has it): it marks
    the assistant's tokens for training masks and renders as its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def compiled(text):
    """The template compiled once (bench.py renders it for every question) in a sandbox with
    apply_chat_template's settings, filters and globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = (
        lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys))
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(text)


def template(model):
    """The checkpoint's chat template, else its family's where the tokenizer has the tokens,
    else None."""
    if model.chat_template is not None:
        return model.chat_template
    text, tokens = FAMILY_TEMPLATES.get(model.kind, (None, ()))
    tok = model.tokenizer
    return text if tok is not None and all(tok.token_to_id(t) is not None for t in tokens) else None


def special_tokens(model):
    """bos_token and the like, as text, from tokenizer_config.json (a string or an
    AddedToken's dict)."""
    found = {name: model.tokenizer_config.get(name) for name in SPECIAL}
    return {k: v.get("content") if isinstance(v, dict) else v for k, v in found.items()
            if v is not None}


def render(model, messages, **kwargs):
    """The conversation as text, with add_generation_prompt and any other template variable
    (enable_thinking, ...) in kwargs."""
    text = template(model)
    if text is None:
        raise ValueError("the model has no chat template (no chat_template in "
                         "tokenizer_config.json) and its tokenizer lacks the special tokens of "
                         f"the {model.kind} chat format")
    try:
        return compiled(text).render(messages=messages, tools=None, documents=None,
                                     **special_tokens(model), **kwargs)
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"the chat template fails to render: {err}") from None


def end_of_turn(model):
    """The id of the token that ends the assistant's turn in the model's chat format, or None: a
    known end-of-turn token that the template writes and the tokenizer has."""
    text = template(model) or ""
    return next((model.tokenizer.token_to_id(t) for t in END_OF_TURN
                 if t in text and model.tokenizer.token_to_id(t) is not None), None)


def chat_prompt(model, question, **kwargs):
    """One user turn, ready for the answer: (token ids, the stop ids: the model's and the end of
    turn). The rendered text is encoded without the tokenizer's own special tokens, since the
    template writes them (as apply_chat_template does)."""
    if model.tokenizer is None:
        raise ValueError("chat formatting needs the model's tokenizer.json")
    text = render(model, [{"role": "user", "content": question}], add_generation_prompt=True,
                  **kwargs)
    turn = end_of_turn(model)
    stop = model.eos_token_ids + ((turn,) if turn is not None and turn not in model.eos_token_ids
                                  else ())
    return model.tokenizer.encode(text, add_special_tokens=False).ids, stop
