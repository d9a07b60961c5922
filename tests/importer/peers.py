"""Build model folders with the tools people use and record those tools' own greedy output: run as a script, in the
environment that has the tool (onnxruntime-genai beside specdeploy; optimum in a venv of its own, as it needs
transformers < 5), never imported by the tests' process.

    python tests/importer/peers.py genai|optimum JOB.json OUT.json

JOB: {"builds": [[hf_dir, out_dir, precision], ...], "generate": [[model_dir, [prompt ids, ...], new_tokens], ...]}
OUT: {"generated": {model_dir: [[token ids], ...]}}: each prompt's greedy continuation, EOS included where reached.
"""

from __future__ import annotations

import json
import sys


def genai(job: dict) -> dict:
    import onnxruntime_genai as og
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    for hf, out, precision in job["builds"]:
        args = ("", hf, out, precision, "cpu", f"{out}.hf-cache")
        create_model(*args, **parse_extra_options(*args, []))
    generated = {}
    for folder, prompts, new_tokens in job["generate"]:
        model = og.Model(folder)
        outputs = []
        for prompt in prompts:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(prompt)
            tokens = []
            while not generator.is_done():
                generator.generate_next_token()
                tokens.append(int(generator.get_next_tokens()[0]))
            outputs.append(tokens)
        generated[folder] = outputs
    return {"generated": generated}


def optimum(job: dict) -> dict:
    import torch
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTModelForCausalLM

    for hf, out, _ in job["builds"]:
        main_export(hf, output=out, task="text-generation-with-past", device="cpu")
    generated = {}
    for folder, prompts, new_tokens in job["generate"]:
        model = ORTModelForCausalLM.from_pretrained(folder)
        outputs = []
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                                 max_new_tokens=new_tokens, do_sample=False, num_beams=1)
            outputs.append(ids[0, len(prompt):].tolist())
        generated[folder] = outputs
    return {"generated": generated}


if __name__ == "__main__":
    kind, job_path, out_path = sys.argv[1:4]
    with open(job_path) as handle:
        job = json.load(handle)
    result = {"genai": genai, "optimum": optimum}[kind](job)
    with open(out_path, "w") as handle:
        json.dump(result, handle)
