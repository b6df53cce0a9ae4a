"""`contextd keys create|list|revoke`: API keys from the command line.

Over gRPC by default (`--server`, `--api-key`, or CONTEXTD_SERVER / CONTEXTD_API_KEY): an
admin key manages its own tenant's keys, and while a server has no key at all its local
operator may create the first one for any tenant. With `--direct` the command opens the
store itself (`--store`/`--data-dir`, as `serve` does): for an operator creating a key in
a new tenant; on the embedded engine only while no server holds the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from contextd.config import DEFAULT_ADDR, DEFAULT_DATA_DIR, Settings
from contextd.domain.access import ApiKey, KeyRole, check_key_name, new_secret
from contextd.domain.errors import ContextdError, StoreLocked
from contextd.domain.model import DEFAULT_TENANT
from contextd.domain.validation import check_name

_ROLES = {"read": KeyRole.READ, "write": KeyRole.WRITE, "admin": KeyRole.ADMIN}
_EXAMPLES = {
    "create": "contextd keys create --tenant acme --role write --name ci-bot",
    "list": "contextd keys list --api-key $ADMIN_KEY",
    "revoke": "contextd keys revoke 3f2a9c0d1e4b5a69 --api-key $ADMIN_KEY",
}


def add_key_commands(commands: Any) -> None:
    keys = commands.add_parser("keys", help="create, list and revoke API keys")
    verbs = keys.add_subparsers(dest="verb", required=True)
    for verb, help_text in (
        ("create", "create a key; its secret is printed once"),
        ("list", "list the keys of your tenant"),
        ("revoke", "revoke a key of your tenant"),
    ):
        sub = verbs.add_parser(
            verb,
            help=help_text,
            description=help_text,
            epilog=f"example: {_EXAMPLES[verb]}",
        )
        sub.add_argument(
            "--server",
            default=os.environ.get("CONTEXTD_SERVER", DEFAULT_ADDR),
            help="host:port of the server (env CONTEXTD_SERVER; default %(default)s)",
        )
        sub.add_argument(
            "--api-key",
            default=os.environ.get("CONTEXTD_API_KEY"),
            help="an admin key (env CONTEXTD_API_KEY); none for a server without keys",
        )
        sub.add_argument(
            "--direct",
            action="store_true",
            help="open the store instead of calling a server (operators; see --store)",
        )
        sub.add_argument("--store", default=os.environ.get("CONTEXTD_STORE", ""))
        sub.add_argument(
            "--data-dir", default=os.environ.get("CONTEXTD_DATA_DIR", DEFAULT_DATA_DIR)
        )
        sub.add_argument("--json", action="store_true", help="print JSON for scripts")
        if verb == "create":
            sub.add_argument("--tenant", default="", help="the key's tenant (default: yours)")
            sub.add_argument("--role", choices=sorted(_ROLES), required=True)
            sub.add_argument("--name", default="", help="a label for people")
        elif verb == "list":
            sub.add_argument("--include-revoked", action="store_true")
            sub.add_argument(
                "--tenant",
                default=DEFAULT_TENANT,
                help="with --direct: the tenant whose keys to list (over gRPC: your own)",
            )
        else:
            sub.add_argument("key_id", help="the id of the key to revoke")


def _key_json(key: ApiKey) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "tenant": key.tenant,
        "role": key.role.name.lower(),
        "name": key.name,
        "create_time_us": key.create_time_us,
        "revoke_time_us": key.revoke_time_us,
    }


def _print_keys(keys: list[ApiKey], as_json: bool) -> None:
    if as_json:
        print(json.dumps([_key_json(k) for k in keys]))
        return
    print(f"{'KEY ID':<18}{'TENANT':<24}{'ROLE':<8}{'STATE':<9}NAME")
    for k in keys:
        state = "active" if k.active else "revoked"
        print(f"{k.key_id:<18}{k.tenant:<24}{k.role.name.lower():<8}{state:<9}{k.name}")


def _direct(args: argparse.Namespace) -> int:
    from contextd.adapters.open import open_store

    settings = Settings(data_dir=Path(args.data_dir), store=args.store)
    store = open_store(settings)
    try:
        if args.verb == "create":
            tenant = check_name(args.tenant, "tenant") if args.tenant else DEFAULT_TENANT
            key_id, token, hashed = new_secret()
            key = store.create_key(
                ApiKey(key_id, tenant, _ROLES[args.role], check_key_name(args.name), 0), hashed
            )
            _print_created(key, token, args.json)
        elif args.verb == "list":
            tenant = check_name(args.tenant, "tenant")
            _print_keys(store.list_keys(tenant, None, 10_000, args.include_revoked), args.json)
        else:
            # The operator revokes a key of any tenant: the key's own tenant is used.
            found = store.find_key(args.key_id)
            tenant = found[0].tenant if found else DEFAULT_TENANT
            _print_keys([store.revoke_key(tenant, args.key_id)], args.json)
    finally:
        store.close()
    return 0


def _print_created(key: ApiKey, token: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({**_key_json(key), "secret": token}))
        return
    print(f"created key {key.key_id} (tenant {key.tenant}, role {key.role.name.lower()})")
    print("its secret, shown only now; send it as `authorization: Bearer <secret>`:")
    print(token)


def _over_grpc(args: argparse.Namespace) -> int:
    """The verb through the client package (contextd_client), like every client verb."""
    from contextd_client import Client
    from contextd_client import KeyRole as ClientRole

    def key_of(key: Any) -> ApiKey:
        def us(when: Any) -> int | None:
            return None if when is None else int(when.timestamp() * 1_000_000)

        return ApiKey(
            key.key_id,
            key.tenant,
            KeyRole[key.role.name],
            key.name,
            us(key.create_time) or 0,
            us(key.revoke_time),
        )

    with Client(args.server, api_key=args.api_key, timeout=30.0) as client:
        if args.verb == "create":
            key, secret = client.create_key(
                role=ClientRole[args.role.upper()], tenant=args.tenant, name=args.name
            )
            _print_created(key_of(key), secret, args.json)
        elif args.verb == "list":
            keys = [key_of(k) for k in client.list_keys(include_revoked=args.include_revoked)]
            _print_keys(keys, args.json)
        else:
            _print_keys([key_of(client.revoke_key(key_id=args.key_id))], args.json)
    return 0


def run_key_command(args: argparse.Namespace) -> int:
    """Run a `keys` verb; errors are one line on stderr and exit status 1 (2 for usage)."""
    from contextd_client import ContextdError as ClientError
    from contextd_client import Unavailable as ClientUnavailable

    try:
        return _direct(args) if args.direct else _over_grpc(args)
    except ClientUnavailable as exc:
        print(
            f"contextd keys {args.verb}: cannot reach the server at {args.server}: {exc.message}",
            file=sys.stderr,
        )
        return 1
    except ClientError as exc:
        reason = f" ({exc.reason})" if exc.reason else ""
        print(f"contextd keys {args.verb}: {exc.message}{reason}", file=sys.stderr)
        return 1
    except (ContextdError, StoreLocked) as exc:
        print(f"contextd keys {args.verb}: {exc}", file=sys.stderr)
        return 1
