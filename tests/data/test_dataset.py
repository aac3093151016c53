import json

from dflash_train.data.dataset import collate, load_conversations


def test_loss_mask_covers_exactly_the_assistant_turns(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 12 + 30?"},
                {"role": "assistant", "content": "12 + 30 = 42."},
                {"role": "user", "content": "Thank you!"},
                {"role": "assistant", "content": "You are welcome."}]
    (tmp_path / "one.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    row = load_conversations(str(tmp_path / "one.jsonl"), tok, 512)[0]
    ids, mask = row["input_ids"], row["loss_mask"]
    assert len(ids) == len(mask)
    # contiguous runs of supervised tokens, decoded
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    assert [tok.decode(r) for r in runs] == ["12 + 30 = 42.<|im_end|>", "You are welcome.<|im_end|>"]
    assert tok.decode(ids).startswith("<|im_start|>system\n")


def test_collate_pads_right():
    b = collate([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}],
                pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.loss_mask.tolist() == [[False, True, True], [True, False, False]]
