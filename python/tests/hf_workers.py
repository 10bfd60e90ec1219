"""What each rank process of test_torch_hf.py runs (a module of its own, so that the forked
processes find it): Hugging Face models cut by pipec.torch.hf_layers, trained one step under
pipec plans with PyTorch's runtime; each rank saves its gradients and the last stage's losses."""

import os

V, T, B = 64, 16, 2  # vocabulary, sequence, microbatch size
SCHEDULES = [
    ("1f1b", {}),
    ("interleaved-1f1b", {"vpp": 2}),
    ("zb-h1", {}),
    ("zb-v", {"vpp": 2}),
    ("zb-auto", {}),  # memory_limit: below 1f1b's peak, set per world
    ("dualpipe-v", {"vpp": 2}),
]


def config_of(family: str, tied: bool):
    import transformers  # noqa: PLC0415

    common = dict(vocab_size=V, tie_word_embeddings=tied)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=6, n_embd=32, n_head=4, n_positions=T,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         **common)
    else:
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=6, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=T,
                                          rope_theta=10000.0, **common)
    # eager attention: the implementation that is not causal unless given a mask.
    config._attn_implementation = "eager"
    return config


def build(family: str, tied: bool):
    """A small transformers causal LM (6 blocks), the same in every process."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    config = config_of(family, tied)
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # weights large enough that the gradients depend on them
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


def batch(microbatches: int, step: int = 0):
    import torch  # noqa: PLC0415
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, V, (microbatches * B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits, target):
    import torch  # noqa: PLC0415
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def plan_for(family: str, tied: bool, schedule: str, flags: dict, world: int):
    import pipec  # noqa: PLC0415
    import pipec.torch  # noqa: PLC0415
    spec = pipec.torch.model_spec(config_of(family, tied), seq_length=T, microbatch_size=B)
    m = 2 * world  # dualpipe-v needs 2 x pp
    if schedule == "zb-auto":
        peak = max(r.peak_activation_bytes
                   for r in pipec.compile(spec, "1f1b", pp=world, microbatches=m).stats.ranks)
        flags = dict(flags, memory_limit=int(peak * 0.8))
    return pipec.compile(spec, schedule, pp=world, microbatches=m, **flags)


def run_cases(rank, world, init_file, out_dir, cases, train_steps):
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import pipec.torch  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for case in cases:
            plan = plan_for(case["family"], case["tied"], case["schedule"], case["flags"], world)
            model = build(case["family"], case["tied"])
            layers = pipec.torch.hf_layers(model)
            runner = pipec.torch.PipelineRunner(plan, pipec.torch.stage_modules(plan, layers),
                                                loss_fn)
            mine = [p for s in plan.stages if s["rank"] == rank
                    for layer in layers[s["layers"][0]:s["layers"][1]] for p in layer.parameters()]
            optimizer = torch.optim.AdamW(mine, lr=1e-2) if train_steps else None
            names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
            grads, history = {}, []
            for step in range(max(1, train_steps)):
                tokens, targets = batch(plan.microbatches)  # the same batch: memorised
                losses = []
                runner.step(tokens, target=targets, losses=losses)
                if losses:
                    history.append(sum(x.item() for x in losses) / len(losses))
                if step == 0:
                    grads = {names[id(p)]: p.grad.detach().clone() for p in mine}
                if optimizer:
                    optimizer.step()
                    optimizer.zero_grad()
            tied = pipec.torch.tied_pairs(layers)
            gap = ((tied["embedding"] - tied["head"]).abs().max().item()
                   if set(tied) == {"embedding", "head"} and all(
                       any(p is q for q in mine) for p in tied.values()) else None)
            torch.save({"grads": grads, "losses": history, "tied_gap": gap},
                       os.path.join(out_dir, f"{case['id']}-rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
