from slime_spec.rollout.sample import Sample, SpecStats, Status


def test_spec_counters_sum_over_requests_in_both_sglang_spellings():
    s = SpecStats()
    # SGLang 0.5.23 (tokenizer_manager): spec_num_correct_drafts / spec_num_proposed_drafts
    s.add_meta_info({"completion_tokens": 9, "spec_verify_ct": 3, "spec_num_correct_drafts": 6,
                     "spec_num_proposed_drafts": 9})
    # releases around PR #13754: spec_accept_token_num / spec_draft_token_num
    s.add_meta_info({"completion_tokens": 1, "spec_verify_ct": 1, "spec_accept_token_num": 0,
                     "spec_draft_token_num": 3})
    assert (s.completion_tokens, s.verify_ct, s.accept_token_num, s.draft_token_num) == (10, 4, 6, 12)
    assert s.accept_length == 2.5  # token-weighted over both requests, not the mean of 3.0 and 1.0


def test_no_verify_pass_means_accept_length_one_and_no_rate():
    s = SpecStats()
    s.add_meta_info({"completion_tokens": 5})  # SGLang omits spec keys when there was no verify pass
    assert s.accept_length == 1.0 and s.accept_token_num is None


def test_sample_dict_round_trip():
    s = Sample(index=1, group_index=0, prompt="1+1=", label="2", tokens=[5, 6, 7], response="2", response_length=1,
               rollout_log_probs=[-0.1], reward=1.0, status=Status.TRUNCATED)
    s.spec.add_meta_info({"completion_tokens": 1, "spec_verify_ct": 1})
    assert Sample.from_dict(s.to_dict()) == s and s.prompt_length == 2
