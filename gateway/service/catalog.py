"""The models the gateway serves and the targets that serve them.

:class:`ModelCatalog` answers what a client may name: the model list (the local model,
its LoRA adapters as vLLM lists them, the aliases and providers), one model's card, and
the targets of a model name (an adapter of the local model goes to the local replicas;
the rest as :class:`~gateway.service.targets.Targets` resolves it).  :func:`chat_targets`
and :func:`text_targets` give the :class:`~gateway.core.target.Target` a loop sends to
by target name.
"""

from __future__ import annotations

from typing import Any

from gateway.core.config import LOCAL_TARGET
from gateway.core.errors import InvalidRequest, NotFound, Unavailable
from gateway.core.outputs import ModelCard, ModelList
from gateway.core.target import Target
from gateway.service.local import LocalChat
from gateway.service.local_completions import LocalCompletions
from gateway.service.loop import Resolve
from gateway.service.provider_chat import ProviderChat
from gateway.service.targets import Targets


def chat_targets(local: LocalChat, providers: ProviderChat | None) -> Resolve:
    """The target a chat call's loop sends to by name: the local replicas, or the hosted
    providers (a 503 when none is configured)."""

    def target(name: str) -> Target[Any]:
        if name == LOCAL_TARGET:
            return local
        if providers is None:
            raise Unavailable("no hosted providers are configured", code="no_providers")
        return providers

    return target


def text_targets(completions: LocalCompletions) -> Resolve:
    """The target a text completion's loop sends to by name: the local replicas only."""

    def target(name: str) -> Target[Any]:
        if name == LOCAL_TARGET:
            return completions
        raise InvalidRequest(  # the text loop is given the local target only
            f"{name} does not serve text completions", param="model", code="unsupported_model"
        )

    return target


class ModelCatalog:
    """The served models and a model name's targets, over the local chat (its model and
    adapters) and the configured aliases and providers (``targets``)."""

    def __init__(self, local: LocalChat, targets: Targets, model_name: str) -> None:
        self._local = local
        self._targets = targets
        self._model = model_name

    @property
    def targets(self) -> Targets:
        return self._targets

    @property
    def model_name(self) -> str:
        return self._model

    def models(self) -> ModelList:
        local = self._local
        if not local.dispatcher.replicas:  # a provider-only gateway
            return ModelList(data=[ModelCard(id=name) for name in self._targets.names()])
        max_len = local.engine.capabilities.max_model_len if local.ready else None
        root = local.engine.capabilities.model if local.ready else None
        cards = [ModelCard(id=self._model, max_model_len=max_len, root=root or self._model)]
        adapters = local.adapters
        for a in adapters.listed() if adapters is not None else ():  # as vLLM lists them
            cards.append(
                ModelCard(id=a.name, max_model_len=max_len, root=a.path, parent=self._model)
            )
        cards += [ModelCard(id=name) for name in self._targets.names()[1:]]
        return ModelList(data=cards)

    def model(self, model_id: str) -> ModelCard:
        self._local.adapter(model_id)  # one in the resolver directory is known from now on
        card = next((m for m in self.models().data if m.id == model_id), None)
        if card is None:
            raise NotFound(
                f"The model '{model_id}' does not exist", param="model", code="model_not_found"
            )
        return card

    def check_model(self, model: str) -> None:
        """``model`` is the local model and it can serve now."""
        self._local.check_model(model, self._model)

    def resolve(self, model: str) -> list[str]:
        """The targets of ``model``: a LoRA adapter of the local model (not shadowed by an
        alias) is served by the local replicas, under that adapter; else as
        :class:`~gateway.service.targets.Targets` resolves it (a 404 naming it)."""
        if model not in self._targets.names() and self._local.adapter(model) is not None:
            return [LOCAL_TARGET]
        return self._targets.resolve(model)

    def local_targets(self, model: str, what: str = "text completions") -> list[str]:
        """The targets of ``model`` that serve ``what`` (the local replicas), in alias
        order; a 400 when it has none."""
        names = [n for n in self.resolve(model) if n == LOCAL_TARGET]
        if not names:
            raise InvalidRequest(
                f"'{model}' is served by hosted providers only; {what} are "
                "served by the local model",
                param="model",
                code="unsupported_model",
            )
        return names

    def served(self, model: str) -> str:
        """The model a text completion names in its answer: the adapter it ran under, or
        the local model (an alias of it answers as the local model)."""
        return model if self._local.adapter(model) is not None else self._model
