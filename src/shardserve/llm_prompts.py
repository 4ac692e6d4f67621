"""The offline API's prompts as the engine takes them: text, token ids, vLLM's prompt dicts (with
images, for a model that reads them) and chat conversations, each encoded once into `Encoded`."""

from __future__ import annotations

import dataclasses

from shardserve.chat_messages import check_template_options, image_urls, normalize_messages, render_chat
from shardserve.llm_inputs import Encoded, Prompt, prompt_images
from shardserve.sampling_params import SamplingParams
from shardserve.tokenizer.image_prompt import ImagePrompt, chat_ids
from shardserve.tokenizer.images import MediaFetch


class PromptEncoder:
    """`tok` (None: prompts must be token ids); `images`: how the model's prompts hold images (None:
    it reads none); `images_refused`: why the engine refuses images ("" where it takes them);
    `media`: how images given by http(s) URL are fetched."""

    def __init__(self, tok, images: ImagePrompt | None, images_refused: str, media: MediaFetch = MediaFetch()):
        self.tok, self.images, self.images_refused, self.media = tok, images, images_refused, media

    def encode(self, prompt: Prompt) -> Encoded:
        if isinstance(prompt, Encoded):
            return prompt
        if isinstance(prompt, dict):
            return self._dict(prompt)
        if not isinstance(prompt, str):
            return Encoded(list(prompt))
        if self.tok is None:
            raise ValueError("this model has no tokenizer: pass prompts as token ids")
        return Encoded(self.tok.encode(prompt), text=prompt)

    def _dict(self, prompt: dict) -> Encoded:
        """vLLM's prompt dict (llm_inputs.check_prompt_dict), with its images where it has any."""
        images = prompt_images(prompt)
        if not images:
            return self.encode(prompt.get("prompt", prompt.get("prompt_token_ids")))
        if self.images is None:
            raise ValueError(f"multi_modal_data: {self.images_refused}")
        ids, placed = self.images.encode_prompt(prompt.get("prompt"), prompt.get("prompt_token_ids"), images)
        return Encoded(ids, tuple(placed), prompt.get("prompt"))

    def prepare(self, prompt: Prompt, sp: SamplingParams) -> Encoded:
        """The prompt's tokens as the engine takes them (`truncate_prompt_tokens`), and `bad_words`
        as token sequences (the engine has no tokenizer)."""
        if sp.bad_words:
            if self.tok is None:
                raise ValueError("bad_words need the model's tokenizer")
            sp.update_from_tokenizer(self.tok)
        enc = self.encode(prompt)
        if enc.images and sp.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        return dataclasses.replace(enc, token_ids=sp.truncate(enc.token_ids))

    def chat(self, conversation: list[dict], tools: list[dict] | None, options: dict | None) -> Encoded:
        """A conversation in OpenAI's shapes, normalized and rendered as the server does
        (chat_messages.py; `options`: its chat template options, None values left out)."""
        if self.tok is None:
            raise ValueError("this model has no chat template")
        options = {k: v for k, v in (options or {}).items() if v is not None}
        messages = normalize_messages(conversation, self.images_refused)
        check_template_options(messages, options)
        urls = [self.media.as_data_url(u) for u in image_urls(messages)]  # http(s) ones fetched as the server does
        ids, images = chat_ids(self.tok, self.images, render_chat(self.tok, messages, tools, options), urls)
        return Encoded(ids, tuple(images))
