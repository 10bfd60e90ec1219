"""What each rank process of test_torch_train.py runs (a module of its own, so that
torch.multiprocessing's spawned processes can import it)."""

import os


def run_cases(rank, world, init_file, out_dir, cfg, cases):
    """Train one step of every case under its pipec plan; save this rank's gradients and, on the
    last stage's rank, the microbatch losses."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import pipec  # noqa: PLC0415
    import pipec.torch  # noqa: PLC0415
    import torch_gpt  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for case in cases:
            plan = pipec.compile(torch_gpt.model_spec(cfg), case["schedule"], pp=world,
                                 microbatches=case["microbatches"], **case["flags"])
            layers = torch_gpt.build_layers(cfg, seed=0)
            runner = pipec.torch.PipelineRunner(plan, pipec.torch.stage_modules(plan, layers),
                                                torch_gpt.loss_fn, comms=case["comms"])
            tokens, targets = torch_gpt.batch(cfg, plan.microbatches, step=0)
            losses = []
            runner.step(tokens, target=targets, losses=losses)
            grads = {}
            for stage in plan.stages:
                if stage["rank"] != rank:
                    continue
                for layer in range(*stage["layers"]):
                    for name, param in layers[layer].named_parameters():
                        grads[f"{layer}.{name}"] = param.grad.detach().clone()
            torch.save({"grads": grads, "losses": [x.item() for x in losses]},
                       os.path.join(out_dir, f"{case['id']}-rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def profile_and_train(rank, world, init_file, out_dir, cfg, steps):
    """pipec.torch.profile of the model's stage modules, a 1f1b plan compiled from the measured
    costs, then `steps` timed training steps of it; rank 0 saves what it measured and predicted."""
    import json  # noqa: PLC0415
    import statistics  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import pipec  # noqa: PLC0415
    import pipec.torch  # noqa: PLC0415
    import torch_gpt  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        spec = torch_gpt.model_spec(cfg)
        plan = pipec.compile(spec, "1f1b", pp=world, microbatches=2 * world)
        layers = torch_gpt.build_layers(cfg, seed=0)
        stages = pipec.torch.stage_modules(plan, layers)
        tokens, targets = torch_gpt.batch(cfg, plan.microbatches, step=0)
        mb = tokens.shape[0] // plan.microbatches
        costs_path = os.path.join(out_dir, "costs.json")
        before = [p.detach().clone() for m in stages if m is not None for p in m.parameters()]
        costs = pipec.torch.profile(plan, stages, tokens[:mb], torch_gpt.loss_fn, targets[:mb],
                                    costs_path, steps=4,
                                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1))
        after = [p.detach() for m in stages if m is not None for p in m.parameters()]
        restored = all(torch.equal(a, b) for a, b in zip(before, after))
        dist.barrier()
        fitted = pipec.compile(spec, "1f1b", pp=world, microbatches=2 * world, costs=costs_path)
        runner = pipec.torch.PipelineRunner(fitted, stages, torch_gpt.loss_fn)
        times = []
        for step in range(steps):
            tokens, targets = torch_gpt.batch(cfg, fitted.microbatches, step=step)
            dist.barrier()
            t0 = time.perf_counter()
            runner.step(tokens, target=targets, losses=[])
            dist.barrier()
            times.append(1e3 * (time.perf_counter() - t0))
        if rank == 0:
            with open(os.path.join(out_dir, "result.json"), "w") as f:
                json.dump({"costs": costs, "restored": restored,
                           "measured_ms": statistics.median(times[1:]),
                           "predicted_ms": fitted.stats.step_time,
                           "stages": json.loads(fitted._h.json())["stages"]}, f)
    finally:
        dist.destroy_process_group()
