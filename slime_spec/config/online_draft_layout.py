"""The layouts an online EAGLE3 draft (--enable-draft-training) cannot be trained in, in one wording: the doctor
refuses them before launch (doctor/flag_checks.py), a Trainer built without the doctor (tests, benches) refuses them
when it is built."""

# (problem, fix) templates over pp_size / cp_size
WITH_PIPELINE_STAGES = (
    "--enable-draft-training with --pipeline-model-parallel-size {pp_size}: the online EAGLE3 draft reads the hidden "
    "states of layers spread over the pipeline stages, which the trainer does not gather",
    "--pipeline-model-parallel-size 1 with --enable-draft-training (or train the draft without stages)")
WITH_CONTEXT_PARALLEL = (
    "--enable-draft-training with --context-parallel-size {cp_size}: the online EAGLE3 draft trains on whole "
    "sequences, which the trainer does not gather from the context-parallel ranks",
    "--context-parallel-size 1 with --enable-draft-training")


# (refused(pp_size, cp_size), (problem, fix)): the one statement of each refusal, for the doctor and the trainer
REFUSED_LAYOUTS = ((lambda pp_size, cp_size: pp_size > 1, WITH_PIPELINE_STAGES),
                   (lambda pp_size, cp_size: cp_size > 1, WITH_CONTEXT_PARALLEL))


def refusal(pp_size: int, cp_size: int, enable_draft_training: bool) -> str | None:
    """"problem; fix: ..." for a layout the online draft cannot be trained in; None where it can (or none is)."""
    for refused, (problem, fix) in REFUSED_LAYOUTS:
        if enable_draft_training and refused(pp_size, cp_size):
            return f"{problem.format(pp_size=pp_size, cp_size=cp_size)}; fix: {fix}"
    return None
