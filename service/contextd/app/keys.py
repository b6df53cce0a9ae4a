"""API keys: create (the secret is returned once), list, revoke; and authenticate a call.

The rules of who may do what live here; the gRPC edge (`contextd.api.auth`) only reads the
`authorization` metadata and the method's required role.
"""

from __future__ import annotations

import logging

from contextd.app.base import UseCases
from contextd.app.paging import page_size
from contextd.domain.access import (
    ApiKey,
    Caller,
    KeyRole,
    check_key_name,
    key_refused,
    keyless_refused,
    new_secret,
    parse_token,
    secret_matches,
)
from contextd.domain.errors import InvalidArgument, PermissionDenied, Unauthenticated
from contextd.domain.idempotency import RequestRecord
from contextd.domain.model import DEFAULT_TENANT, Page
from contextd.domain.validation import check_name

log = logging.getLogger(__name__)

# The operator of a server without keys (on a loopback address only: see api/server.py).
LOCAL_OPERATOR = Caller(DEFAULT_TENANT, KeyRole.ADMIN)
# How many keys a replica remembers as seen active (`KeyCalls.admit_unconfirmed`); past
# it the memory starts again (a key then costs one confirmed look-up more).
KNOWN_KEYS = 4096


class KeyCalls(UseCases):
    def authenticate(self, bearer: str | None) -> Caller:
        """The caller a call's `authorization` value stands for.

        Without a key: the local operator while no active key exists, else
        UNAUTHENTICATED. With one: its tenant and role if it is known, active and its
        secret matches (compared in constant time). Failures are logged with the key id
        at most, never the secret.
        """
        if bearer is None:
            self._require_no_active_key()
            return LOCAL_OPERATOR
        parsed = parse_token(bearer)
        if parsed is None:
            log.info("call with a malformed API key refused")
            raise Unauthenticated("the API key is malformed (expected ctxd_<id>_<secret>)")
        key_id, secret = parsed
        found = self._store.find_key(key_id)
        if found is None or not secret_matches(secret, found[1]) or not found[0].active:
            log.info("call with an unknown or revoked API key refused", extra={"key_id": key_id})
            raise key_refused()
        key = found[0]
        if self._store.confirms_owed_keys:  # only there are calls admitted from it
            known = self._known_keys
            if len(known) >= KNOWN_KEYS and key_id not in known:
                known.clear()
            known[key_id] = found
        return Caller(key.tenant, key.role, key.key_id)

    def _require_no_active_key(self) -> None:
        """UNAUTHENTICATED (logged) when any key is active: a call without one is refused."""
        if self._store.any_active_key():
            log.info("call without an API key refused")
            raise keyless_refused()

    def writes_confirm_keys(self) -> bool:
        """Whether this store's writes confirm a key owed to them (`owed_key_check` in
        domain/access.py): then a call may be admitted unconfirmed."""
        return self._store.confirms_owed_keys

    def admit_unconfirmed(self, bearer: str | None) -> Caller | None:
        """The caller `bearer` stands for, from what this replica knows, without asking
        the store; None when it does not know (then `authenticate`). Without a key: the
        local operator. With one: a key this replica found active before, whose secret
        matches (constant time). Whether the key (or the absence of any) still stands is
        then owed: the call's write checks it, or `confirm` does before it is answered."""
        if bearer is None:
            return LOCAL_OPERATOR
        parsed = parse_token(bearer)
        if parsed is None:
            return None
        key_id, secret = parsed
        found = self._known_keys.get(key_id)
        if found is None or not secret_matches(secret, found[1]):
            return None
        key = found[0]
        return Caller(key.tenant, key.role, key.key_id)

    def confirm(self, caller: Caller) -> None:
        """Check what admitting `caller` unconfirmed assumed: its key is still active (or,
        without one, no key is active). UNAUTHENTICATED, logged, when it is not."""
        if not caller.key_id:
            self._require_no_active_key()
            return
        found = self._store.find_key(caller.key_id)
        if found is None or not found[0].active:
            self.refused(caller)
            raise key_refused()

    def refused(self, caller: Caller) -> None:
        """Log the refusal of a caller admitted unconfirmed, and forget its key."""
        if not caller.key_id:
            log.info("call without an API key refused")
            return
        self._known_keys.pop(caller.key_id, None)
        log.info("call with an unknown or revoked API key refused", extra={"key_id": caller.key_id})

    def create_key(
        self,
        caller: Caller,
        tenant: str,
        role: KeyRole,
        name: str,
        record: RequestRecord | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key and its secret (returned only here). An admin key creates keys of
        its own tenant; the service's operators (admin keys of the tenant "default", and
        the local operator of a server without keys) create keys of any tenant."""
        tenant = check_name(tenant, "tenant") if tenant else caller.tenant
        operator = caller.tenant == DEFAULT_TENANT and caller.role == KeyRole.ADMIN
        if tenant != caller.tenant and not operator:
            raise PermissionDenied(
                "an admin key creates keys of its own tenant only (admin keys of the tenant "
                "'default' create keys of any tenant)",
                reason="ROLE_TOO_LOW",
            )
        check_key_name(name)
        key_id, token, hashed = new_secret()
        # A retry gets the first key back WITHOUT its secret: the response recorded for
        # retries holds no secret, since the server keeps none (a lost first response
        # means: revoke that key and create another).
        recorded = record.with_encoder(lambda key: record.encode((key, ""))) if record else None
        key = self._store.create_key(ApiKey(key_id, tenant, role, name, 0), hashed, recorded)
        return key, token

    def list_keys(
        self, caller: Caller, requested_size: int, token: str, include_revoked: bool
    ) -> Page[ApiKey]:
        size = page_size(requested_size)
        params = ("keys", caller.tenant, include_revoked)
        position = self._pages.decode(token, params, (str,))
        after = str(position.position[0]) if position else None
        keys = self._store.list_keys(caller.tenant, after, size + 1, include_revoked)
        return Page(*self._pages.cut(keys, size, params, lambda k: (k.key_id,)))

    def revoke_key(
        self, caller: Caller, key_id: str, record: RequestRecord | None = None
    ) -> ApiKey:
        if not key_id or len(key_id) > 64:
            raise InvalidArgument("key_id must be a key's id", field="key_id")
        revoked = self._store.revoke_key(caller.tenant, key_id, record)
        self._known_keys.pop(key_id, None)
        return revoked
