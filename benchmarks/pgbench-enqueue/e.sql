\set account random(0, 999)
BEGIN;
INSERT INTO bench_events (account, amount) VALUES (:account, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account;
INSERT INTO ok_keys AS k (ordering_key, last_seq) VALUES ('account-' || :account, 1) ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + 1 RETURNING last_seq;
COMMIT;
