"""OpenAI's Conversations API: `/v1/conversations`. A conversation is a session: its items
prefill it, and a response with `conversation` continues it (app/sessions/conversations.py
holds the transaction; this router parses and shapes)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from app.sessions import Conversations
from app.store import ConversationRecord
from model.chat_template import ChatTemplate

from ..http.deps import OwnerDep, ServicesDep, SessionsDep, SettingsDep, chat_template
from ..http.errors import ErrorType, error_docs
from .responses import PageDep, PageQuery, item, page, renderer
from .responses_schemas import (
    ConversationCreate,
    ConversationObject,
    ConversationUpdate,
    Deleted,
    Item,
    ItemList,
    ItemsCreate,
)

router = APIRouter(prefix="/v1", tags=["conversations"])
NOT_FOUND = error_docs(ErrorType.object_not_found)
WRITES = error_docs(
    ErrorType.object_not_found, ErrorType.no_chat_template, ErrorType.prompt_too_long, ErrorType.session_busy,
    ErrorType.session_conflict, ErrorType.storage_full, ErrorType.invalid_request, ErrorType.queue_full,
    ErrorType.outcome_unknown,
)  # fmt: skip


def get_conversations(services: ServicesDep) -> Conversations:
    return services.conversations


ConversationsDep = Annotated[Conversations, Depends(get_conversations)]
TemplateDep = Annotated[ChatTemplate, Depends(chat_template)]


def _shape(conversation_id: str, record: ConversationRecord) -> dict:
    return {"id": conversation_id, "object": "conversation", "created_at": record.created_at,
            "metadata": record.metadata or {}}  # fmt: skip


@router.post(
    "/conversations", response_model=ConversationObject, summary="A new conversation", responses=WRITES
)
async def create_conversation(
    body: ConversationCreate, owner: OwnerDep, conversations: ConversationsDep, template: TemplateDep, sessions: SessionsDep,
    settings: SettingsDep,
) -> dict:  # fmt: skip
    items = [item(m) for m in body.items or []]
    made = await conversations.create(
        owner, items, body.metadata, renderer(template, settings, sessions.engine)
    )
    return _shape(*made)


@router.get("/conversations/{conversation_id}", response_model=ConversationObject, responses=NOT_FOUND)
async def get_conversation(conversation_id: str, owner: OwnerDep, conversations: ConversationsDep) -> dict:
    return _shape(conversation_id, await conversations.get(owner, conversation_id))


@router.post("/conversations/{conversation_id}", response_model=ConversationObject, responses=NOT_FOUND)
async def update_conversation(
    conversation_id: str, body: ConversationUpdate, owner: OwnerDep, conversations: ConversationsDep
) -> dict:
    return _shape(conversation_id, await conversations.update(owner, conversation_id, body.metadata))


@router.delete("/conversations/{conversation_id}", response_model=Deleted, responses=NOT_FOUND)
async def delete_conversation(conversation_id: str, owner: OwnerDep, conversations: ConversationsDep) -> dict:
    await conversations.delete(owner, conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@router.get("/conversations/{conversation_id}/items", response_model=ItemList, responses=NOT_FOUND)
async def list_items(
    conversation_id: str,
    owner: OwnerDep,
    conversations: ConversationsDep,
    query: PageDep,
) -> dict:
    return page(await conversations.items(owner, conversation_id), query)


@router.post(
    "/conversations/{conversation_id}/items",
    response_model=ItemList,
    summary="Append items: the conversation's session prefills them",
    responses=WRITES,
)
async def add_items(
    conversation_id: str, body: ItemsCreate, owner: OwnerDep, conversations: ConversationsDep, template: TemplateDep,
    sessions: SessionsDep, settings: SettingsDep,
) -> dict:  # fmt: skip
    items = [item(m) for m in body.items]
    await conversations.add(owner, conversation_id, items, renderer(template, settings, sessions.engine))
    return page(items, PageQuery(len(items) or 1, "asc", None))


@router.get("/conversations/{conversation_id}/items/{item_id}", response_model=Item, responses=NOT_FOUND)
async def get_item(
    conversation_id: str, item_id: str, owner: OwnerDep, conversations: ConversationsDep
) -> dict:
    return await conversations.item(owner, conversation_id, item_id)


@router.delete(
    "/conversations/{conversation_id}/items/{item_id}", response_model=ConversationObject, responses=NOT_FOUND
)
async def delete_item(
    conversation_id: str, item_id: str, owner: OwnerDep, conversations: ConversationsDep
) -> dict:
    await conversations.delete_item(owner, conversation_id, item_id)
    return _shape(conversation_id, await conversations.get(owner, conversation_id))
