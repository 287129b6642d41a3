"""Multi-turn chats that keep their KV session between turns (`LLM.conversation`)."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any, Optional, Union

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
        self.messages: list[dict[str, Any]] = []
        self._kv = KvSession(llm._engine, llm._lock)
        self.reset()

    def reset(self) -> None:
        """Forget the turns (the system message stays) and the cached tokens."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._kv.close()
        self._kv = KvSession(self.llm._engine, self.llm._lock)

    def send(
        self, text: Union[str, list[dict[str, Any]]]
    ) -> Generator[str, None, GenerationResult]:
        """Adds the user message `text` (or a list of content parts, images among them for a
        vision-language model) and streams the answer, which joins the conversation (the
        generator's return value is its GenerationResult). A turn that fails (for example
        past the context length) leaves the conversation as it was."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self.llm._chat_prompt(messages, None, self.chat_format, self.template_vars)
        result = yield from self.llm._run(prompt.ids, self.params, self._kv, prompt.images)
        self.messages = [*messages, {"role": "assistant", "content": result.text}]
        return result

    @property
    def cached_tokens(self) -> int:
        """Tokens of this conversation held in the KV cache."""
        return len(self._kv.ids)

    def close(self) -> None:
        self._kv.close()
