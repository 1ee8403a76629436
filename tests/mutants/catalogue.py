"""The planted faults that CI must catch (`make test-faults`; issue 38, item 6).

Each fault is one line of app/ or model/ changed the way a plausible bug would change it,
pinned to an invariant: the state (dropped, zeroed, stale, off by one position), the fence,
the ledger, the batch, prefix reuse, the Responses chain, the tokenizer and the families.
`tests/mutants/run.py` applies each to a copy of the tree and runs the tests named with it;
a fault that none of them fails has survived, and the run fails. A fault's `old` must occur
exactly once in its file (a substring of one line), so a catalogue that no longer matches the
code fails at once (`tests/mutants/test_catalogue.py` checks it in `make test`) rather than
planting nothing.

The tests are the few that must catch the fault, chosen so that the whole run stays within
about ten minutes on two cores: name the cheapest test that pins the invariant, not every
test that would notice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # one line: the bug it plants
    file: str  # relative to the repository root
    old: str  # occurs exactly once in `file`, within one line
    new: str
    tests: tuple[str, ...]  # pytest node ids, one of which at least must fail


FAULTS: tuple[Fault, ...] = (
    # -- the state ---------------------------------------------------------------------------
    Fault(
        "state-dropped-per-request",
        "a request on a session starts from a new state, not the session's (hot path)",
        "app/engine/runner.py",
        "            state = req.start\n",
        "            state = self.lm.new_state(1)\n",
        ("tests/app/test_sessions.py::test_score_without_and_with_commit",),
    ),
    Fault(
        "mamba-state-dropped-per-request",
        "a Mamba request starts from its session's state with the SSM state zeroed (hot path)",
        "app/engine/runner.py",
        "            state = req.start\n",
        '            state = req.start.replace(ssm=torch.zeros_like(req.start["ssm"])) '
        'if "ssm" in req.start.tensors else req.start\n',
        (
            "tests/app/test_ssm_api.py::test_scores_are_the_same_in_one_request_or_many[mamba-cuts1]",
            "tests/app/test_ssm_api.py::test_a_streamed_generation_is_the_generation[mamba]",
        ),
    ),
    Fault(
        "txl-keys-zeroed-per-request",
        "a Transformer-XL request starts with its cached keys zeroed (hot path)",
        "app/engine/runner.py",
        "            state = req.start\n",
        '            state = req.start.replace(k=torch.zeros_like(req.start["k"])) '
        'if "k" in req.start.tensors and "mem" in req.start.tensors else req.start\n',
        (
            "tests/app/test_invariants.py::test_boundary_invariance_end_to_end",
            "tests/app/test_invariants.py::test_generation_split_over_requests_matches_one_request",
        ),
    ),
    Fault(
        "mamba-state-dropped-on-load",
        "a Mamba state loaded from Redis comes back with its SSM state zeroed",
        "model/mamba.py",
        "        return self._state(dict(tensors))  # every tensor is persistent: nothing to recompute",
        '        return self._state({**tensors, "ssm": torch.zeros_like(tensors["ssm"])})',
        (
            "tests/model/test_ssm.py::test_checkpoint_and_state_bytes_round_trip[mamba]",
            "tests/app/test_ssm_api.py::test_history_fork_rollback_export_and_import_continue_exactly[mamba]",
        ),
    ),
    Fault(
        "txl-keys-zeroed-on-load",
        "a Transformer-XL state loaded from Redis rebuilds its cached keys as zeros",
        "model/transformer_xl.py",
        'return self._state({**tensors, "k": k, "v": v})',
        'return self._state({**tensors, "k": torch.zeros_like(k), "v": v})',
        (
            "tests/faults/test_replicas.py::test_handover_between_replicas_matches_one_process",
            "tests/app/test_history.py::test_fork_at_a_version_and_rollback_reach_the_past_state",
        ),
    ),
    Fault(
        "rlt-state-dropped-per-call",
        "the RLT's recurrent state s is zeroed after every call instead of carried",
        "model/rlt.py",
        'tensors["s"] = s_all[:, -1].to(state["s"].dtype)',
        'tensors["s"] = torch.zeros_like(state["s"])',
        ("tests/model/test_rlt.py::test_next_logits_come_from_the_state",),
    ),
    Fault(
        "stale-hot-cache",
        "Redis confirms any held commit as current: a replica keeps serving its older hot copy",
        "app/store/lua/session.lua",
        "if held == '' or (redis.call('HGET', keys[1], 'commit') or '') ~= held then",
        "if held == '' then",
        (
            "tests/faults/test_replicas.py::test_a_hot_cache_never_outlives_a_commit_redis_lost",
            "tests/faults/test_replicas.py::test_handover_between_replicas_matches_one_process",
        ),
    ),
    Fault(
        "delta-off-by-one-position",
        "a delta commit starts one position late, so a rebuilt state misses a token",
        "app/sessions/service.py",
        "            since=meta.n_tokens,\n",
        "            since=meta.n_tokens + 1,\n",
        ("tests/app/test_history.py::test_every_kept_version_rebuilds_to_its_own_snapshot",),
    ),
    Fault(
        "txl-memory-off-by-one-position",
        "Transformer-XL counts one memory row more than a batched stream holds (a padding row attended)",
        "model/transformer_xl.py",
        "mask = self._mask(T, M, state.n_tokens.clamp(max=cfg.mem_len))",
        "mask = self._mask(T, M, (state.n_tokens + 1).clamp(max=cfg.mem_len))",
        (
            "tests/model/test_transformer_xl.py::test_batching_streams_of_different_lengths",
            "tests/model/test_fast_paths.py::test_txl_batched_decode_steps_equal_each_stream_alone",
        ),
    ),
    Fault(
        "transcript-off-by-one-position",
        "a generation's transcript segment says it starts one token later than it does",
        "app/sessions/run.py",
        "            self.writer.meta.n_tokens,\n",
        "            self.writer.meta.n_tokens + 1,\n",
        ("tests/app/test_history.py::test_the_transcript_is_what_the_state_consumed",),
    ),
    Fault(
        "rollback-to-the-wrong-version",
        "a rollback restores the version before the one asked for",
        "app/sessions/service.py",
        "at = await self._read_version(session_id, version, None, owner)",
        "at = await self._read_version(session_id, max(0, version - 1), None, owner)",
        ("tests/app/test_history.py::test_fork_at_a_version_and_rollback_reach_the_past_state",),
    ),
    # -- the fence and the commit ------------------------------------------------------------
    Fault(
        "fence-removed",
        "a commit no longer checks the version its writer started from",
        "app/store/lua/commit.lua",
        "if v ~= ARGV[1] then return {'status', 'conflict', 'version', v} end",
        "if false then return {'status', 'conflict', 'version', v} end",
        (
            "tests/app/test_store.py::test_expired_lock_never_loses_an_update",
            "tests/app/test_sessions.py::test_error_event_and_nothing_committed_when_the_fence_fails",
        ),
    ),
    Fault(
        "commit-without-version-bump",
        "a commit writes its state but leaves the version where it was",
        "app/store/lua/commit.lua",
        "redis.call('HSET', KEYS[1], 'version', new, 'n_tokens'",
        "redis.call('HSET', KEYS[1], 'version', v, 'n_tokens'",
        ("tests/app/test_store.py::test_expired_lock_never_loses_an_update",),
    ),
    # -- the ledger --------------------------------------------------------------------------
    Fault(
        "ledger-session-quota-unchecked",
        "the ledger admits a session past its key's session quota",
        "app/store/lua/ledger.lua",
        "if not known and count >= most_sessions then return 'sessions', count, total end",
        "if false then return 'sessions', count, total end",
        ("tests/app/test_quotas.py::test_a_key_holds_at_most_its_sessions_on_every_replica",),
    ),
    Fault(
        "ledger-bytes-counted-twice",
        "the ledger adds a session's whole size on every write, not what it grew by",
        "app/store/lua/ledger.lua",
        "total = redis.call('HINCRBY', bytes, '_total', new - old)",
        "total = redis.call('HINCRBY', bytes, '_total', new)",
        ("tests/hostile/test_quota_ledger.py::test_usage_equals_what_redis_holds_after_every_route",),
    ),
    # -- the batch ---------------------------------------------------------------------------
    Fault(
        "batch-step-fails-every-row",
        "a batched step that raises fails every row, not only the row whose own step raises",
        "app/engine/runner.py",
        "                step([r])\n",
        "                self._fail(r, exc)\n",
        (
            "tests/faults/test_batch_faults.py::test_a_prefill_batch_that_raises_fails_only_the_row_whose_chunk_raises",
        ),
    ),
    Fault(
        "batch-forward-fails-every-row",
        "a batched decode forward that raises after sampling fails every row of the batch",
        "app/engine/runner.py",
        "            self._consume_alone(rows, d.ids, batch, exc)",
        "            [self._fail(r, exc) for r in rows]",
        (
            "tests/faults/test_batch_faults.py::test_a_decode_forward_that_raises_once_consumes_each_row_alone",
        ),
    ),
    Fault(
        "non-finite-row-fails-every-row",
        "one row's non-finite logits fail every row of its batch",
        "app/engine/runner.py",
        "            if ok and r.ids:\n",
        "            if (ok := all(s[3] for s in sampled)) and r.ids:\n",
        ("tests/faults/test_batch_faults.py::test_a_row_with_non_finite_logits_fails_alone[1]",),
    ),
    Fault(
        "compiled-step-drops-its-inputs-guards",
        "the compiled step checks no guard at all, its inputs' (the state's shapes, its full axes) included",
        "app/engine/compiler.py",
        "    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)",
        "    return torch.compiler.skip_all_guards_unsafe(entries)",
        ("tests/app/test_compiler_llama.py::test_the_compiled_step_checks_its_inputs_not_the_model",),
    ),
    Fault(
        "readied-window-one-row-behind",
        "a compiled step's window readied one row behind: the state it leaves lacks its newest key",
        "model/state/arena.py",
        "        after = arena.data[:, :, end - keep : end]",
        "        after = arena.data[:, :, end - keep - 1 : end - 1]",
        (
            "tests/model/test_state.py::test_a_readied_step_grows_as_the_in_place_step_does",
            "tests/app/test_compiler_llama.py::test_the_compiled_llama_step_is_adopted_within_its_bound[fp32]",
        ),
    ),
    # -- prefix reuse ------------------------------------------------------------------------
    Fault(
        "prefix-indexed-one-token-short",
        "a commit indexes its state under the hash of its tokens less the last (a wrong prefix)",
        "app/sessions/service.py",
        "tokens_hash = prefixes.extend(old.tokens_hash, segment.ids)",
        "tokens_hash = prefixes.extend(old.tokens_hash, segment.ids[:-1])",
        (
            "tests/app/test_prefix_reuse.py::test_a_resent_conversation_forks_its_prefix_and_matches_a_full_prefill",
        ),
    ),
    Fault(
        "prefix-rest-off-by-one",
        "a reused prefix's fork consumes the prefix's last token again",
        "app/sessions/choices.py",
        "return meta.id, tokens[held:]",
        "return meta.id, tokens[held - 1 :]",
        (
            "tests/app/test_prefix_reuse.py::test_a_resent_conversation_forks_its_prefix_and_matches_a_full_prefill",
        ),
    ),
    Fault(
        "find-prefix-claims-the-longest",
        "the prefix index says the longest prefix matched whichever one did",
        "app/store/lua/find_prefix.lua",
        "if v then return {'index', i, 'entry', v} end",
        "if v then return {'index', 1, 'entry', v} end",
        (
            "tests/app/test_prefix_reuse.py::test_a_resent_conversation_forks_its_prefix_and_matches_a_full_prefill",
        ),
    ),
    # -- the Responses chain -----------------------------------------------------------------
    Fault(
        "responses-reference-forgets-the-chain",
        "a turn rendered whole keeps only the last of the chain's turns before it",
        "app/sessions/starts.py",
        "flat = [m for t in walk.turns for m in t]",
        "flat = [m for t in walk.turns[-1:] for m in t]",
        ("tests/app/test_responses.py::test_each_turn_renders_alone_and_equals_the_whole_conversation[shakespeare]",),
    ),
    Fault(
        "responses-turn-alone-skips-the-closing",
        "a turn rendered alone does not prefill what closes the previous reply (its turn stop)",
        "app/sessions/starts.py",
        "rest = [*base.closing, *later]",
        "rest = [*later]",
        ("tests/app/test_responses.py::test_each_turn_renders_alone_and_equals_the_whole_conversation[shakespeare]",),
    ),
    Fault(
        "responses-chain-off-by-one",
        "a continued response consumes its base's last token again",
        "app/sessions/starts.py",
        "return Start(found[0], tokens[n:], found[1], found[2], in_place)",
        "return Start(found[0], tokens[n - 1 :], found[1], found[2], in_place)",
        ("tests/app/test_responses.py::test_a_response_stored_before_chains_continues[shakespeare]",),
    ),
    # -- the tokenizer and the families ------------------------------------------------------
    Fault(
        "byte-decoder-splits-characters",
        "the streaming byte decoder emits each byte alone, splitting multi-byte characters",
        "model/tokenizer.py",
        "return self._utf8.decode(bytes([token_id]))",
        'return bytes([token_id]).decode("utf-8", errors="replace")',
        ("tests/model/test_tokenizer.py::test_multibyte_character_split_across_calls",),
    ),
    Fault(
        "word-tokenizer-eos-after-every-line",
        "the word tokenizer ends the last line with <eos> too",
        "model/tokenizer.py",
        "            if i < len(lines) - 1:\n",
        "            if i < len(lines):\n",
        (
            "tests/model/test_word_tokenizer.py::"
            "test_blank_lines_are_a_lone_eos_and_a_last_line_without_newline_has_none",
        ),
    ),
    Fault(
        "llama-window-one-too-short",
        "a LLaMA query sees W - 1 window positions before it, not W",
        "model/attention.py",
        "(dist >= 0) & (dist <= W))",
        "(dist >= 0) & (dist < W))",
        ("tests/model/test_llama.py::test_the_model_is_its_definition_within_and_beyond_the_window",),
    ),
    Fault(
        "llama-sinks-one-short",
        "a LLaMA stream attends to S - 1 sinks, not S",
        "model/attention.py",
        "(spos >= 0) & (spos < S) & (spos <= pos[:, :, None])",
        "(spos >= 0) & (spos < S - 1) & (spos <= pos[:, :, None])",
        ("tests/model/test_llama.py::test_the_model_is_its_definition_within_and_beyond_the_window",),
    ),
    Fault(
        "llama-sinks-at-their-absolute-distance",
        "past the window, a LLaMA query sees its sinks at their absolute distance, not from the cache end",
        "model/attention.py",
        "angles(pos.clamp(max=S + W))",
        "angles(pos)",
        ("tests/model/test_llama_window_parity.py::test_forward_past_the_window_equals_transformers",),
    ),
    Fault(
        "llama-decode-step-unmasks-the-sinks",
        "a LLaMA decode step scores every stored sink slot, a batch's padding and unfilled ones too",
        "model/attention.py",
        "return _masked(_product(qs, sk[0].transpose(-1, -2)), masks[0], T)",
        "return _product(qs, sk[0].transpose(-1, -2))",
        (
            "tests/model/test_llama_window_parity.py"
            "::test_the_engines_decode_step_past_the_window_equals_transformers",
        ),
    ),
    Fault(
        "llama-one-stream-step-drops-the-sinks-values",
        "a batch-1 decode step weighs the sinks in its softmax but adds none of their values",
        "model/attention.py",
        "out = torch.baddbmm(out, p[..., :Ks], sk[1][0])",
        "out = out",
        (
            "tests/model/test_llama.py::test_one_streams_decode_step_attends_as_the_general_layout_to_the_bit",
            "tests/model/test_llama_window_parity.py::test_forward_past_the_window_equals_transformers",
        ),
    ),
    Fault(
        "prefill-keeps-the-first-positions-logits",
        "a prefill without log-probs runs the head over the chunk's first position, not its last",
        "model/family.py",
        "return x[:, -1:] if self.last_logits else x",
        "return x[:, :1] if self.last_logits else x",
        (
            "tests/model/test_fast_paths.py::"
            "test_a_prefill_without_logprobs_runs_the_head_over_its_last_position_alone",
        ),
    ),
    Fault(
        "llama-fused-step-counts-an-empty-window",
        "a batch's fused decode step gives a row whose keys are all sinks its masked window's "
        "log-sum-exp of 0: the sinks share the softmax with a window that is not there",
        "model/attention.py",
        'lse = lse.masked_fill(mask.amax(-1) == float("-inf"), float("-inf"))',
        "lse = lse",
        ("tests/model/test_llama.py::test_a_decode_step_of_many_rows_runs_the_fused_kernel_as_each_row_alone",),
    ),
    Fault(
        "delta-keeps-the-snapshots-fixed-tensors",
        "a state rebuilt from deltas keeps its snapshot's fixed-size tensors (LLaMA's last_hidden)",
        "model/state/blob.py",
        "tensors[name] = rows.to(base.dtype) if rows.is_floating_point() else rows",
        'tensors[name] = rows if name == "n_tokens" else base',
        ("tests/faults/test_crash.py::test_sigkill_during_streaming_generations_llm_and_ssm[llama]",),
    ),
    Fault(
        "q4-k-groups-lose-their-mins",
        "a Q4_K file read packed keeps each group's scale but not its min: w = (q - 8) d sc_j + 8 d sc_j",
        "model/llama_gguf.py",
        "zero = 8 * scale - dmin[..., None] * m",
        "zero = 8 * scale",
        ("tests/model/test_packed.py::test_gguf_q4_blocks_are_packed_as_they_are[Q4_K]",),
    ),
    Fault(
        "int4-kernel-reads-one-column-twice",
        "recur's int4 kernel, one row: the odd column of each pair multiplied by the even column's input",
        "model/kernels/int4_body.inc",
        "Isa::set1(xg[k + 1])",
        "Isa::set1(xg[k])",
        (
            "tests/model/test_kernels.py::test_int4_kernel_is_the_fp32_product[1-64-avx512-fp16-scales]",
            "tests/model/test_kernels.py::test_int4_kernel_is_the_fp32_product[1-64-avx2-fp16-scales]",
        ),
    ),
    Fault(
        "auto-int4-for-a-rounded-token-table",
        "--precision auto serves int4 for a file whose token table the int8 blocks round again",
        "model/llama_gguf.py",
        'all(k == "Q8_0" for k in ends)',
        "True",
        ("tests/model/test_packed.py::test_auto_serves_int4_where_it_keeps_the_files_weights[Q4_1-types3-False]",),
    ),
    # -- issue 39's smaller faults -------------------------------------------------------------
    Fault(
        "n-choices-admitted-one-by-one",
        "a request's new sessions take the tenant's last places one at a time: racing requests all fail",
        "app/sessions/choices.py",
        "async with service.tenants.places(owner, new):",
        "async with service.tenants.places(owner, 0):",
        ("tests/hostile/test_choices_quota.py::test_racing_requests_for_the_last_places_serve_one",),
    ),
    Fault(
        "body-walk-a-python-step-per-item",
        "RequestBody's walk visits every item of a list of numbers in Python",
        "app/api/schemas.py",
        "                elif not kinds <= _NUMBERS:",
        "                elif True:",
        (
            "tests/hostile/test_large_bodies.py::test_validating_a_body_of_many_items_costs_a_small_multiple_of_parsing_it",
        ),
    ),
)
