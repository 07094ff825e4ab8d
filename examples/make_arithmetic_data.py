"""Write seeded synthetic datasets as jsonl for the CPU recipe and quick experiments.

    python examples/make_arithmetic_data.py --out data/arith_train.jsonl --num 2000
    python examples/make_arithmetic_data.py --task arithmetic --num-operands 3 --max-digits 3 --operators "+-*" \
        --out data/arith_hard.jsonl
    python examples/make_arithmetic_data.py --task preference --out data/arith_dpo.jsonl
    python examples/make_arithmetic_data.py --task countdown --num-numbers 4 --out data/countdown.jsonl
    python examples/make_arithmetic_data.py --task safety --num 256 --out examples/data/safety_pairs.jsonl
    python examples/make_arithmetic_data.py --task tool --num 512 --min-digits 2 --operators "*" \
        --out examples/data/tool_arithmetic.jsonl

Tool rows are chat messages with two worked calculator calls (the agent recipe,
conf/experiment/cpu_agent_calculator.yaml). Safety rows are preference pairs (refusals chosen) for the multi-task
recipe. Arithmetic and preference rows use DataConfig / PreferenceDataConfig defaults; countdown rows need
`data.meta_keys=[numbers,target]` and `reward.name=countdown`.
"""

from __future__ import annotations

import argparse

from mcore_rl.data.synthetic import (make_arithmetic_rows, make_countdown_rows, make_preference_rows,
                                     make_safety_rows, make_tool_arithmetic_rows, write_jsonl)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["arithmetic", "preference", "countdown", "safety", "tool"],
                        default="arithmetic")
    parser.add_argument("--out", required=True, help="output .jsonl path")
    parser.add_argument("--num", type=int, default=1000, help="number of rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-operands", type=int, default=2, help="arithmetic/preference: operands per problem")
    parser.add_argument("--min-digits", type=int, default=1, help="arithmetic/preference: fewest digits an operand has")
    parser.add_argument("--max-digits", type=int, default=2, help="arithmetic/preference: most digits an operand has")
    parser.add_argument("--operators", default="+-", help="arithmetic/preference: any of '+-*'")
    parser.add_argument("--num-numbers", type=int, default=4, help="countdown: numbers offered")
    parser.add_argument("--max-number", type=int, default=50, help="countdown: largest number offered")
    parser.add_argument("--use-all-numbers", action="store_true", help="countdown: every number exactly once")
    args = parser.parse_args()

    arithmetic = dict(
        num_operands=args.num_operands, min_digits=args.min_digits, max_digits=args.max_digits, operators=args.operators
    )
    if args.task == "arithmetic":
        rows = make_arithmetic_rows(args.num, seed=args.seed, **arithmetic)
    elif args.task == "preference":
        rows = make_preference_rows(args.num, seed=args.seed, **arithmetic)
    elif args.task == "safety":
        rows = make_safety_rows(args.num, seed=args.seed)
    elif args.task == "tool":
        rows = make_tool_arithmetic_rows(args.num, seed=args.seed, min_digits=args.min_digits,
                                         max_digits=args.max_digits, operators=args.operators)
    else:
        rows = make_countdown_rows(
            args.num,
            seed=args.seed,
            num_numbers=args.num_numbers,
            max_number=args.max_number,
            use_all_numbers=args.use_all_numbers,
        )
    path = write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} {args.task} rows to {path}")


if __name__ == "__main__":
    main()
