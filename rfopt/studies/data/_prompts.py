"""System prompts the loaders put first in every ``prompt`` conversation."""

#: Arithmetic and GSM8K: the XML format of the TRL/RapidFire AI GSM8K GRPO recipes, which the
#: format rewards check.
REASONING_SYSTEM_PROMPT = (
    "Respond in the following format:\n"
    "<reasoning>\n...\n</reasoning>\n"
    "<answer>\n...\n</answer>\n"
    "Put only the final number inside the answer tags."
)

#: DeepMath-103K: the prompt its authors (and Qwen2.5-Math) use; the model's last \boxed{}
#: is what math_verify compares with ``final_answer``.
BOXED_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

#: NuminaMath-TIR: the prompt of TRL's GRPO tutorial on this dataset (DeepSeek-R1 style).
THINK_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>"
)
