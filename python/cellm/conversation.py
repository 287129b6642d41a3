"""Multi-turn chats that keep their KV session between turns (`LLM.conversation`)."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any, Optional

from cellm.generation import GenerationResult, KvSession
from cellm.sampling import SamplingParams

if TYPE_CHECKING:
    from cellm.llm import LLM


class Conversation:
    """A multi-turn chat that keeps its KV session between turns: each turn renders the whole
    conversation but prefills only what follows the tokens already cached (the new user
    message and the template's markers), as an interactive chat should."""

    def __init__(
        self,
        llm: LLM,
        system: Optional[str] = None,
        *,
        chat_format: str = "auto",
        params: Optional[SamplingParams] = None,
        template_vars: Optional[Mapping[str, Any]] = None,
    ) -> None:
        self.llm, self.chat_format = llm, chat_format
        self.template_vars = dict(template_vars or {})
        self.params = params if params is not None else SamplingParams()
        self.system = system
        self.messages: list[dict[str, str]] = []
        self._kv = KvSession(llm._engine, llm._lock)
        self.reset()

    def reset(self) -> None:
        """Forget the turns (the system message stays) and the cached tokens."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._kv.close()
        self._kv = KvSession(self.llm._engine, self.llm._lock)

    def send(self, text: str) -> Generator[str, None, GenerationResult]:
        """Adds the user message `text` and streams the answer, which joins the conversation
        (the generator's return value is its GenerationResult). A turn that fails (for
        example past the context length) leaves the conversation as it was."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.llm.apply_chat_template(
            messages, chat_format=self.chat_format, **self.template_vars
        )
        ids = self.llm.tokenizer.encode(prompt, add_special_tokens=False)
        result = yield from self.llm._run(ids, self.params, self._kv)
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result

    @property
    def cached_tokens(self) -> int:
        """Tokens of this conversation held in the KV cache."""
        return len(self._kv.ids)

    def close(self) -> None:
        self._kv.close()
