"""The weight-update protocol of the SGLang in use: session or not, and which runners load what.

Pure functions only (the HTTP calls live in weight_sync/transports/http_transports.py and sync.py), so every decision
and
every payload is unit tested against SGLang's own io_struct definitions.

Protocols (read from sglang 0.5.23's scheduler_components/weight_updater.py):
- session (0.5.23): `/begin_weight_update {selector}` ... updates ... `/end_weight_update {}`. An update
  outside a session fails. Each update carries `selector` ("target" | "draft" | "all"): the runners
  that load the tensors; the distributed path receives a bucket once and loads it into every
  selected runner. `/update_weights_from_disk` has no selector: it always reloads every runner.
- sessionless (older releases): no session routes, no `selector`. `update_weights_from_distributed`
  loads the target only (sglang#27718: the MTP draft is never updated); the tensor and disk paths
  load every runner (so an external draft is overwritten by target tensors: slime#1177).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from slime_spec.speculative.settings import Algorithm

Selector = Literal["target", "draft", "all"]
Transport = Literal["distributed", "tensor", "disk"]

SESSION_MIN_VERSION = (0, 5, 23)
# Speculative algorithms whose draft is the model's own MTP layers when no other draft path is given.


@dataclass(frozen=True)
class Protocol:
    session: bool  # has /begin_weight_update ... /end_weight_update and per-request `selector`
    version: str | None


def parse_version(version: str | None) -> tuple[int, ...] | None:
    """'0.5.23' / '0.4.6.post4' / '0.5.0rc1' -> (0, 5, 23) / (0, 4, 6) / (0, 5, 0); None if unreadable."""
    if not version:
        return None
    parts = []
    for piece in str(version).split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


def detect_protocol(version: str | None, begin_route_status: int | None) -> Protocol:
    """Decide from `/get_server_info`'s `version` and the HTTP status of `GET /begin_weight_update`.

    The route probe wins when it is conclusive: 404 = no session routes; 405 (route exists, POST only),
    200 or 422 = it exists. Otherwise the version decides (session routes since 0.5.23).
    """
    if begin_route_status == 404:
        return Protocol(session=False, version=version)
    if begin_route_status in (200, 405, 422):
        return Protocol(session=True, version=version)
    parsed = parse_version(version)
    if parsed is None:
        raise ValueError(f"cannot tell the engine's weight-update protocol: version={version!r}, "
                         f"GET /begin_weight_update answered {begin_route_status}; the engine's "
                         f"/get_server_info must report `version`")
    return Protocol(session=parsed >= SESSION_MIN_VERSION, version=version)


@dataclass(frozen=True)
class SpecSetup:
    """What speculative decoding the engines run, from the forwarded SGLang flags."""

    algorithm: str | None = None
    draft_model_path: str | None = None
    model_path: str | None = None

    @classmethod
    def from_server_args(cls, server_args: dict, model_path: str | None) -> "SpecSetup":
        return cls(algorithm=server_args.get("speculative_algorithm"),
                   draft_model_path=server_args.get("speculative_draft_model_path"), model_path=model_path)

    @property
    def resolved_algorithm(self) -> Algorithm | None:
        """spec.Algorithm (NEXTN is EAGLE); None without speculation."""
        if self.algorithm in (None, "") or str(self.algorithm).upper() == "NONE":
            return None
        return Algorithm.parse(self.algorithm)

    @property
    def uses_draft(self) -> bool:
        algorithm = self.resolved_algorithm
        return algorithm is not None and algorithm.uses_draft_model

    @property
    def native_mtp(self) -> bool:
        """The draft is the target checkpoint's own MTP layers (EAGLE/NEXTN with no separate draft path)."""
        own_path = self.draft_model_path in (None, "", self.model_path)
        algorithm = self.resolved_algorithm
        return algorithm is not None and algorithm.can_draft_with_target_mtp and own_path


@dataclass(frozen=True)
class SelectorPlan:
    """Which runners load the target tensors, the MTP tensors and a separate draft's own tensors
    (None: tensors of that kind are not sent)."""

    target: Selector
    mtp: Selector | None
    reason: str
    draft: Selector | None = None


def plan_selectors(spec: SpecSetup, has_mtp_layers: bool, transport: Transport, session: bool,
                   trains_draft: bool = False) -> SelectorPlan:
    """Choose `selector` per tensor kind, or refuse a combination that would corrupt or skip the draft.

    - native MTP draft: "all" for every tensor: the MTP layers load into the draft runner, and the draft
      also loads the shared embedding / lm_head from the target names (sglang models/mimo_mtp.py).
    - external, untrained draft (EAGLE3, STANDALONE, a separate draft path): "target" only, MTP tensors
      not sent: the draft must never receive target tensors (slime#1177).
    - external draft trained online (`trains_draft`, --enable-draft-training): target tensors "target",
      the draft's own tensors "draft" (each runner gets only its own), the session opens with "all".
    - no draft (none, NGRAM): "target"; MTP tensors are not sent (no runner serves them).
    """
    if trains_draft:
        return _plan_trained_draft(spec, transport, session)
    if not spec.uses_draft:
        return SelectorPlan("target", None, f"speculative_algorithm={spec.algorithm!r}: no draft runner")
    if spec.native_mtp:
        if not has_mtp_layers:
            raise ValueError(f"speculative_algorithm={spec.algorithm} drafts with the model's own MTP layers, but "
                             "the trained model has none: set --mtp-num-layers to the checkpoint's MTP layer "
                             "count, or give --sglang-speculative-draft-model-path for an external draft")
        if not session and transport == "distributed":
            raise ValueError("this SGLang has no weight-update session, and its update_weights_from_distributed "
                             "loads the target only (sglang#27718): the MTP draft would never follow the policy. "
                             "Use --weight-sync-transport tensor or disk, or upgrade SGLang to >= 0.5.23")
        return SelectorPlan("all", "all", "native MTP draft: MTP layers and the shared embedding/head "
                                          "must reach the draft runner")
    if transport == "disk":
        raise ValueError(f"--weight-sync-transport disk with an external draft ({spec.algorithm}, draft path "
                         f"{spec.draft_model_path!r}): /update_weights_from_disk has no selector and reloads "
                         "every runner from the target checkpoint, overwriting the draft (slime#1177). "
                         "Use --weight-sync-transport distributed or tensor")
    if not session and transport == "tensor":
        raise ValueError("this SGLang has no `selector`, and its update_weights_from_tensor loads every runner: "
                         f"the external draft ({spec.algorithm}) would receive target tensors (slime#1177). "
                         "Use --weight-sync-transport distributed, or upgrade SGLang to >= 0.5.23")
    return SelectorPlan("target", None, f"external draft ({spec.algorithm}) is not trained: it keeps its own "
                                        "weights, target tensors go to the target runner only")


def _plan_trained_draft(spec: SpecSetup, transport: Transport, session: bool) -> SelectorPlan:
    if not spec.uses_draft or spec.native_mtp:
        raise ValueError(f"--enable-draft-training trains a separate draft (EAGLE3), but the engines run "
                         f"speculative_algorithm={spec.algorithm!r} with draft path {spec.draft_model_path!r}: "
                         "set --sglang-speculative-algorithm EAGLE3 and --sglang-speculative-draft-model-path, "
                         "or drop --enable-draft-training")
    if not session:
        raise ValueError("--enable-draft-training sends the draft's tensors with selector 'draft', which this "
                         "SGLang does not have (no weight-update session): upgrade SGLang to >= 0.5.23, or "
                         "drop --enable-draft-training")
    if transport == "disk":
        raise ValueError("--weight-sync-transport disk with --enable-draft-training: /update_weights_from_disk "
                         "has no selector and reloads every runner from the target checkpoint. Use "
                         "--weight-sync-transport distributed or tensor")
    return SelectorPlan("target", None, f"external draft ({spec.algorithm}) trained online: target tensors "
                                        "to the target runner, the draft's own tensors to the draft runner",
                        draft="draft")


def session_selector(plan: SelectorPlan) -> Selector:
    """The selector a session opens with: the union of the runners any update in it touches."""
    selectors = {plan.target} | {s for s in (plan.mtp, plan.draft) if s}
    if selectors == {"target"}:
        return "target"
    if selectors == {"draft"}:
        return "draft"
    return "all"


# Payloads: one function per route, field names exactly as io_struct defines them.

def begin_payload(selector: Selector) -> dict:
    return {"selector": selector}


def end_payload() -> dict:
    return {}


def init_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str) -> dict:
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def destroy_group_payload(group_name: str) -> dict:
    return {"group_name": group_name}


def distributed_payload(names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str,
                        selector: Selector, weight_version: str | None, flush_cache: bool, session: bool,
                        load_format: str | None = None) -> dict:
    payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
               "flush_cache": flush_cache, "weight_version": weight_version}
    if load_format is not None:
        payload["load_format"] = load_format
    if session:
        payload.update(selector=selector, torch_empty_cache=flush_cache)
    return payload


def tensor_payload(serialized_named_tensors: list[str], *, selector: Selector, weight_version: str | None,
                   flush_cache: bool, session: bool, load_format: str | None = None) -> dict:
    payload = {"serialized_named_tensors": serialized_named_tensors, "flush_cache": flush_cache,
               "weight_version": weight_version}
    if load_format is not None:
        payload["load_format"] = load_format
    if session:
        payload.update(selector=selector, torch_empty_cache=flush_cache)
    return payload


def disk_payload(model_path: str, *, weight_version: str | None, session: bool) -> dict:
    payload = {"model_path": model_path, "weight_version": weight_version}
    if session:
        payload["flush_cache"] = True
    return payload


def checksum_payload(selector: Selector, session: bool = True) -> dict:
    payload = {"action": "checksum"}
    if session:
        payload["selector"] = selector
    return payload


def get_weights_payload(name: str, truncate_size: int) -> dict:
    return {"name": name, "truncate_size": int(truncate_size)}


def pause_payload(mode: Literal["abort", "retract", "in_place"] = "retract") -> dict:
    """retract: running requests go back to the queue and are recomputed with the new weights after continue."""
    return {"mode": mode}


def continue_payload() -> dict:
    return {}


def closes_with_last_update(session: bool, transport: Transport) -> bool:
    """Whether a sync's last update request closes it: SGLang >= 0.5.23 labels the weights (`weight_version`) and
    flushes the cache (`flush_cache`, `torch_empty_cache`: what `/flush_cache` does) after that request's load, which
    saves the `/flush_cache` and `/update_weight_version` round trips. Only the last: SGLang relabels after each
    update that carries a version, and one sent with every bucket would name weights a failed sync never finished.
    Sessionless releases keep the separate requests; the disk transport's one update carries the version itself."""
    return session and transport != "disk"


def weight_version_payload(new_version: str) -> dict:
    """Label the weights served once a sync has ended, where its last update did not (`closes_with_last_update`).
    Generation is paused: nothing to abort."""
    return {"new_version": new_version, "abort_all_requests": False}


# The io_struct class each route's body must build (checked in tests with sglang_contract.validate_payload).
ROUTE_STRUCTS = {
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/get_weights_by_name": "GetWeightsByNameReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


def detect_engine_protocol(client) -> Protocol:
    """Ask the engine: `version` from /server_info, and whether /begin_weight_update exists (404 or not).

    The probe is a GET: a POST-only route answers 405 without running, a missing one 404.
    """
    version = client.server_info().get("version")
    return detect_protocol(version, client.status("GET", "/begin_weight_update"))
