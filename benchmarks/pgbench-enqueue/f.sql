\set account random(0, 999)
BEGIN;
INSERT INTO bench_events (account, amount) VALUES (:account, 1);
UPDATE bench_accounts SET balance = balance + 1 WHERE id = :account;
WITH k AS (INSERT INTO ok_keys AS k (ordering_key, last_seq) VALUES ('account-' || :account, 1) ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + 1 RETURNING last_seq) INSERT INTO ok_outbox (ordering_key, seq, id, topic, headers, payload, created_at) SELECT 'account-' || :account, last_seq, md5(random()::text), 'bench.cost', '{}', convert_to(repeat('.', 200), 'UTF8'), now() FROM k RETURNING seq;
COMMIT;
