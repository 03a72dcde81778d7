"""Hand-made rows of the paper's ten tasks, in the fields of the Hugging
Face datasets lm-eval 0.4 loads for them, and local lm-eval task
definitions that run lm-eval's own task (its prompt, choices and metrics)
on files of such rows: shared by the prompt tests and the lm-eval parity
test."""

import json
import os

ROWS = {
    "lambada": [
        {"text": "The cell is the basic unit of life"},
        {"text": "Water boils at one hundred degrees"},
    ],
    "arc_easy": [
        {
            "id": "Mercury_1",
            "question": "Which gas do plants take in?",
            "choices": {
                "text": ["oxygen", "carbon dioxide", "helium", "neon"],
                "label": ["A", "B", "C", "D"],
            },
            "answerKey": "B",
        },
        {
            "id": "Mercury_2",
            "question": "What does the heart pump?",
            "choices": {
                "text": ["air", "blood", "light"],
                "label": ["1", "2", "3"],
            },
            "answerKey": "2",
        },
    ],
    "copa": [
        {
            "premise": "The man broke his toe.",
            "choice1": "He dropped a hammer on his foot.",
            "choice2": "He got a hole in his sock.",
            "question": "cause",
            "idx": 0,
            "label": 0,
        },
        {
            "premise": "The water was cold.",
            "choice1": "It froze.",
            "choice2": "It boiled.",
            "question": "effect",
            "idx": 1,
            "label": 0,
        },
    ],
    "openbookqa": [
        {
            "id": "7-980",
            "question_stem": "The sun is responsible for",
            "choices": {
                "text": ["puppies", "plants sprouting", "the moon", "rocks"],
                "label": ["A", "B", "C", "D"],
            },
            "answerKey": " B",
        },
        {
            "id": "7-981",
            "question_stem": "Light travels",
            "choices": {
                "text": ["fast", "slowly", "backwards", "never"],
                "label": ["A", "B", "C", "D"],
            },
            "answerKey": "A",
        },
    ],
    "piqa": [
        {
            "goal": "How do I boil water?",
            "sol1": "Put it on a stove.",
            "sol2": "Put it in a freezer.",
            "label": 0,
        },
        {
            "goal": "Dry wet hands",
            "sol1": "wave them in water",
            "sol2": "use a towel",
            "label": 1,
        },
    ],
    "hellaswag": [
        {
            "ind": 4,
            "activity_label": "Removing ice from car",
            "ctx_a": "Then, the man writes over the snow covering the window "
            "of a car, and a woman wearing winter clothes smiles.",
            "ctx_b": "then",
            "ctx": "",
            "endings": [
                ", the man adds wax to the windshield [title] and cuts it.",
                ", a person board a ski lift, while two men supporting the "
                "head of the person wearing winter clothes snow as the "
                "we girls sled.",
                ", the man puts on a christmas coat, knitted with netting.",
                ", the man continues removing the snow on his car.",
            ],
            "source_id": "activitynet~v_-1IBHYS3L-Y",
            "split": "train",
            "split_type": "indomain",
            "label": "3",
        },
        {
            "ind": 5,
            "activity_label": "Home and Garden",
            "ctx_a": "[header] How to water plants [title] Fill a can.",
            "ctx_b": "pour it slowly",
            "ctx": "",
            "endings": ["on the soil.", "on the  roof.", "into the sky."],
            "source_id": "wikihow~1",
            "split": "val",
            "split_type": "zeroshot",
            "label": "0",
        },
    ],
    "race": [
        {
            "article": "Tom has a dog. The dog is brown and likes to run.",
            "problems": str(
                [
                    {
                        "answer": "A",
                        "options": ["brown", "white", "black", "green"],
                        "question": "Tom's dog is  _  .",
                    },
                    {
                        "answer": "C",
                        "options": ["Tom", "a cat", "the dog", "a bird"],
                        "question": "Who likes to run?",
                    },
                    {
                        "answer": "B",
                        "options": ["a cat", "a dog", "a fish", "a bird"],
                        "question": "What does Tom have?",
                    },
                ]
            ),
        },
        {
            "article": "Water boils at one hundred degrees.",
            "problems": str(
                [
                    {
                        "answer": "D",
                        "options": ["ten", "fifty", "zero", "one hundred"],
                        "question": "Water boils at how many degrees?",
                    }
                ]
            ),
        },
    ],
    "sciq": [
        {
            "question": "What do plants need to grow?",
            "distractor3": "darkness",
            "distractor1": "salt",
            "distractor2": "sand",
            "correct_answer": "light",
            "support": "  Plants make food from light.",
        },
        {
            "question": "What is the basic unit of life?",
            "distractor3": "atom",
            "distractor1": "rock",
            "distractor2": "organ",
            "correct_answer": "cell",
            "support": "",
        },
    ],
    "siqa": [
        {
            "context": "Tracy gave her friend a gift.",
            "question": "How would Tracy feel afterwards?",
            "answerA": "happy",
            "answerB": "angry",
            "answerC": "bored",
            "label": "1",
        },
        {
            "context": "Sam ran a long race.",
            "question": "What will Sam want to do next?",
            "answerA": "run more",
            "answerB": "sing",
            "answerC": "rest",
            "label": "3",
        },
    ],
    "record": [
        {
            "passage": "The city of Paris hosted the games. France won "
            "gold.\n@highlight\nParis hosted the games\n@highlight\n"
            "France won gold",
            "query": "The athletes from @placeholder celebrated.",
            "entities": ["Paris", "France", "Paris"],
            "entity_spans": {},
            "answers": ["France"],
            "idx": {"passage": 0, "query": 0},
        },
        {
            "passage": "Water boils at one hundred degrees in Celsius.",
            "query": "The scale is called @placeholder.",
            "entities": ["Water", "the Celsius", "Celsius"],
            "entity_spans": {},
            "answers": ["Celsius", "the Celsius"],
            "idx": {"passage": 1, "query": 0},
        },
    ],
}

# Our task -> (lm-eval's task file under lm_eval/tasks, its split).
LM_EVAL_TASKS = {
    "lambada": ("lambada/lambada_openai.yaml", "test"),
    "arc_easy": ("arc/arc_easy.yaml", "test"),
    "copa": ("super_glue/copa/default.yaml", "validation"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "test"),
    "piqa": ("piqa/piqa.yaml", "validation"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation"),
    "race": ("race/race.yaml", "test"),
    "sciq": ("sciq/sciq.yaml", "test"),
    "siqa": ("siqa/siqa.yaml", "validation"),
    "record": ("super_glue/record/default.yaml", "validation"),
}


def write_rows(folder, name, rows=None):
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w") as f:
        for row in ROWS[name] if rows is None else rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_lm_eval_tasks(folder):
    """Writes each task's rows and a task definition `local_<name>` that
    includes lm-eval's own (prompt, choices, metrics) on them; returns the
    folder of definitions (`--include_path`) and `{name: rows file}`."""
    import lm_eval

    tasks_root = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    definitions = os.path.join(folder, "lm_eval_tasks")
    os.makedirs(definitions, exist_ok=True)
    files = {}
    for name, (definition, split) in LM_EVAL_TASKS.items():
        files[name] = write_rows(folder, name)
        with open(os.path.join(definitions, f"local_{name}.yaml"), "w") as f:
            f.write(
                f"include: {os.path.join(tasks_root, definition)}\n"
                f"task: local_{name}\n"
                "tag: []\n"
                "dataset_path: json\n"
                "dataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    {split}: {files[name]}\n"
                "training_split: null\n"
                f"validation_split: {split if split == 'validation' else 'null'}\n"
                f"test_split: {split if split == 'test' else 'null'}\n"
                "fewshot_split: null\n"
            )
    return definitions, files


def install_squad_metrics():
    """lm-eval 0.4.13's ReCoRD task imports
    `transformers.data.metrics.squad_metrics`, which transformers 5 no
    longer has: without this, lm-eval cannot load ReCoRD at all. Registers
    that module with SQuAD's English F1 and exact match taken from lm-eval's
    own MLQA task (its official SQuAD-style scorer), independent of
    `keras_mhf.evaluation.task_formats`."""
    import sys
    import types

    name = "transformers.data.metrics.squad_metrics"
    if name in sys.modules:
        return
    try:
        import transformers.data.metrics.squad_metrics  # noqa: F401

        return
    except ImportError:
        pass
    import transformers.data
    from lm_eval.tasks.mlqa import utils as mlqa

    def compute_f1(gold, prediction):
        gold_tokens = mlqa.normalize_answer(gold, "en").split()
        predicted = mlqa.normalize_answer(prediction, "en").split()
        if not gold_tokens or not predicted:
            return int(gold_tokens == predicted)
        return mlqa.f1_score(prediction, gold, "en")

    def compute_exact(gold, prediction):
        return int(mlqa.exact_match_score(prediction, gold, "en"))

    metrics = types.ModuleType("transformers.data.metrics")
    squad = types.ModuleType(name)
    squad.compute_f1, squad.compute_exact = compute_f1, compute_exact
    metrics.squad_metrics = squad
    transformers.data.metrics = metrics
    sys.modules["transformers.data.metrics"] = metrics
    sys.modules[name] = squad


def squad_metrics_site(folder):
    """A folder whose `sitecustomize.py` runs `install_squad_metrics` in a
    Python started with it on `PYTHONPATH` (lm-eval's command line)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(
            "from tests.evaluation.harness_rows import install_squad_metrics\n"
            "install_squad_metrics()\n"
        )
    return folder
