"""``tracestore create``: a store from a site table (JSON) or from ``--sites N --width W``."""

from __future__ import annotations

import argparse

from ..cliargs import UsageError, load_json_arg, nonneg_int, positive_int, storage_options
from .common import json_out, out

__all__ = ["register"]


def register(add) -> None:
    """Add this module's subcommands through ``add`` (see :func:`tracestore.cli.main.build_parser`)."""
    p = add("create", "create a store from a site table (JSON) or --sites N --width W",
            examples=["tracestore create /data/run1 --sites 20 --width 2048 --moe-layers 40",
                      "tracestore create s3://bucket/run2 --site-table sites.json --endpoint-url http://host:9000"],
            json="print the new store's info as JSON")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--site-table", metavar="FILE", help="JSON: a list of sites {name, width, [kind, fp4_format, "
                     "block_size, scale_encoding]} or an object with 'sites' (+ model, moe_layers, top_k, num_experts, layout)")
    src.add_argument("--sites", type=positive_int, metavar="N", help="N sites of --width values each")
    p.add_argument("--width", type=positive_int, default=2048, metavar="W",
                   help="values per site with --sites (default 2048)")
    p.add_argument("--fp4-format", choices=("nvfp4", "mxfp4"), default="nvfp4",
                   help="FP4 format of every site with --sites: nvfp4 (blocks of 16, E4M3 scales) or mxfp4 "
                        "(blocks of 32, E8M0 scales); default nvfp4")
    p.add_argument("--scale-encoding", choices=("bytes", "lsb"), default=None,
                   help="what a site stores of each block's scale: bytes (the E4M3/E8M0 byte; default) or lsb (its "
                        "least significant bit, 8 blocks per byte: a scale hint, 1/8 of the scale bytes; nvfp4 only; "
                        "the trainer works out the rest from its own activations; makes the store format version 4). "
                        "With --site-table: for the sites that name none")
    p.add_argument("--site-name", default="layers.{i}.moe_in", metavar="PATTERN",
                   help="site name pattern with --sites; {i} is replaced by 0..N-1 (default layers.{i}.moe_in)")
    p.add_argument("--moe-layers", type=positive_int, metavar="L",
                   help="declare L MoE layers (routed-expert trace; default none)")
    p.add_argument("--moe-layer-name", default="layers.{i}.mlp", metavar="PATTERN",
                   help="MoE layer name pattern with --moe-layers; {i} is replaced by 0..L-1 (default layers.{i}.mlp)")
    p.add_argument("--top-k", type=positive_int, default=8, metavar="K",
                   help="routed experts per token and MoE layer, with --moe-layers (default 8)")
    p.add_argument("--num-experts", type=positive_int, default=256, metavar="E",
                   help="experts per MoE layer, with --moe-layers (default 256; ids stored as uint8 up to 256)")
    p.add_argument("--chunk-rows", type=positive_int, metavar="N", help="rows per inner chunk (default 1024)")
    p.add_argument("--shard-bytes", type=positive_int, metavar="BYTES",
                   help="target bytes per shard object (default 16 MiB)")
    p.add_argument("--feature-chunk", type=nonneg_int, metavar="N",
                   help="values per column chunk, for tensor-parallel slices (default 0: whole rows)")
    p.add_argument("--model", metavar="JSON", help="free-form model metadata (JSON or @file.json; default {})")
    p.add_argument("--exist-ok", action="store_true", help="open an existing store with the same declaration")
    p.set_defaults(func=_cmd_create)


def _sites_from_table(table, scale_encoding: str | None = None) -> tuple[list, dict]:
    """A site table: a JSON list of site objects, or an object with ``sites`` and optionally ``model``,
    ``moe_layers``, ``top_k``, ``num_experts``, ``layout`` (a store manifest is accepted as is); ``scale_encoding``
    for the sites that name none."""
    from ..store import Site

    extra: dict = {}
    if isinstance(table, dict):
        sites = table.get("sites")
        for k in ("model", "moe_layers", "top_k", "num_experts"):
            if k in table:
                extra[k] = table[k]
        lay = table.get("layout") or {}
        for k in ("chunk_rows", "shard_bytes", "feature_chunk"):
            if k in lay:
                extra[k] = lay[k]
    else:
        sites = table
    if not isinstance(sites, list) or not sites:
        raise UsageError("site table: expected a non-empty list of sites (or an object with a 'sites' list)")
    try:
        if scale_encoding is not None:
            sites = [{"scale_encoding": scale_encoding, **s} if isinstance(s, dict) else s for s in sites]
        return [Site.from_dict(s) for s in sites], extra
    except (KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"site table: each site needs 'name' and 'width' ({e!r})") from e


def _names(template: str, n: int, option: str) -> list[str]:
    """``template`` formatted with ``i = 0 .. n-1``; one name each (a pattern without ``{i}`` is refused)."""
    try:
        names = [template.format(i=i) for i in range(n)]
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise UsageError(f"{option} {template!r} is not a name pattern: use {{i}} for the index (e.g. "
                         f"'layers.{{i}}.mlp'); {type(e).__name__}: {e}") from e
    if n > 1 and len(set(names)) != n:
        raise UsageError(f"{option} {template!r} gives the same name twice: it must contain {{i}}")
    return names


def _cmd_create(args: argparse.Namespace) -> int:
    from ..errors import StoreExistsError, StoreNotFoundError
    from ..maintenance import info
    from ..store import Site, create_store, open_store

    if args.site_table:
        sites, extra = _sites_from_table(load_json_arg("@" + args.site_table, "--site-table"), args.scale_encoding)
    elif args.sites:
        sites = [Site(name, args.width, fp4_format=args.fp4_format, scale_encoding=args.scale_encoding or "bytes")
                 for name in _names(args.site_name, args.sites, "--site-name")]
        extra = {}
    else:
        raise UsageError("give --site-table FILE or --sites N [--width W]")
    if args.moe_layers is not None:
        extra["moe_layers"] = _names(args.moe_layer_name, args.moe_layers, "--moe-layer-name")
        extra["top_k"] = args.top_k
        extra["num_experts"] = args.num_experts
    for k in ("chunk_rows", "shard_bytes", "feature_chunk"):
        if getattr(args, k) is not None:
            extra[k] = getattr(args, k)
    if args.model:
        extra["model"] = load_json_arg(args.model, "--model")
    opts = storage_options(args, args.url)
    existed = False
    if args.exist_ok:
        try:
            open_store(args.url, storage_options=opts)
            existed = True
        except StoreNotFoundError:
            pass
    try:
        store = create_store(args.url, sites, storage_options=opts, exist_ok=args.exist_ok, **extra)
    except StoreExistsError as e:
        if not args.exist_ok:
            raise StoreExistsError(f"a tracestore store already exists at {args.url} (pass --exist-ok to open "
                                   f"it when it declares the same sites)") from e
        raise
    except TypeError as e:
        raise UsageError(f"bad store declaration: {e}") from e
    if args.json:
        json_out({**info(store), "created": not existed})
    else:
        verb = "opened the existing store" if existed else "created"
        out(f"{verb} {store.url}: {len(store.sites)} sites, {store.payload_bytes_per_token:,} payload bytes/token"
             f", {len(store.moe_layers)} MoE layers (store id {store.store_id})")
    return 0
