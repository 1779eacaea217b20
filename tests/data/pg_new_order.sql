-- One pgbench transaction of the order-entry workload: Swingbench's "new order process" (look
-- up the customer, insert an order and one to five items, take them from a warehouse's stock,
-- set the order's total). pgbench -D customers=N must match the schema's count.
\set cust random(1, :customers)
\set wh random(1, 20)
\set items random(1, 5)
BEGIN;
SELECT customer_id, cust_first_name, cust_last_name, credit_limit, customer_class
  FROM customers WHERE customer_id = :cust;
INSERT INTO orders (order_date, order_mode, customer_id, order_status, order_total, sales_rep_id,
    promotion_id, warehouse_id, delivery_type, cost_of_delivery, wait_till_date,
    delivery_address_id, customer_class, card_id, invoice_address_id)
  SELECT now(), (ARRAY['online', 'direct'])[1 + (random() * 1)::int], :cust,
    1 + (random() * 9)::int, 0, 1 + (random() * 999)::int, 1 + (random() * 99)::int, :wh,
    (ARRAY['Standard', 'Express', 'Next_Day', 'Collection'])[1 + (random() * 3)::int],
    1 + (random() * 4)::int, now() + random() * interval '7 days', c.preferred_address,
    c.customer_class, c.preferred_card, c.preferred_address
  FROM customers c WHERE c.customer_id = :cust
  RETURNING order_id \gset
INSERT INTO order_items (order_id, line_item_id, product_id, unit_price, quantity, dispatch_date,
    gift_wrap, condition, supplier_id, estimated_delivery)
  SELECT :order_id, n, 1 + (random() * 999)::int, (1 + random() * 999)::numeric(8,2),
    1 + (random() * 9)::int, now() + interval '1 day',
    (ARRAY['None', 'Paper', 'Box'])[1 + (random() * 2)::int], 'New', 1 + (random() * 499)::int,
    now() + (2 + random() * 5) * interval '1 day'
  FROM generate_series(1, :items) n;
-- Lock the stock rows in one order first, so concurrent orders cannot deadlock.
SELECT product_id FROM inventories
  WHERE warehouse_id = :wh
    AND product_id IN (SELECT product_id FROM order_items WHERE order_id = :order_id)
  ORDER BY product_id FOR UPDATE;
UPDATE inventories i SET quantity_on_hand = i.quantity_on_hand - oi.quantity
  FROM order_items oi
  WHERE oi.order_id = :order_id AND i.product_id = oi.product_id AND i.warehouse_id = :wh;
UPDATE orders SET order_total =
    (SELECT sum(unit_price * quantity) FROM order_items WHERE order_id = :order_id)
  WHERE order_id = :order_id;
END;
